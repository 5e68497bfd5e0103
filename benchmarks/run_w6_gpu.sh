#!/usr/bin/env bash
# W6 (GPU): the one command to run on a machine with one NVIDIA GPU, from the repo root:
#
#     bash benchmarks/run_w6_gpu.sh [extra benchmarks/w6_gpu.py flags]
#
# On this workplace's device tool: run(command="bash benchmarks/run_w6_gpu.sh", timeout_s=600).
# Results: JSON lines in $W6_OUT (default $OUT/w6_gpu.jsonl when $OUT is a folder, the device
# tool's return folder; else benchmarks/results/w6_gpu.jsonl), the stderr progress log beside it
# (.log). The benchmark keeps itself inside --budget-s (550 s minus the probes' time; set
# W6_BUDGET_S to change the 550) and a watchdog 30 s later; `timeout` is the last resort,
# so the whole command ends inside ~590 s (the device tool's limit is 600 s).
#
# Assumes:
#   * a Python with a CUDA-enabled JAX already installed: $W6_PYTHON; else the active virtual
#     environment's ($VIRTUAL_ENV/bin/python); else the repository's .venv/bin/python where
#     it exists (`make install DEVICE=cuda`); else `python3` from PATH (on the device image,
#     where .venv does not travel, that is the image's Python with jax +
#     jax-cuda13-plugin). The interpreter chosen is printed first. Nothing is installed
#     here: if JAX has no GPU backend the script stops with a clear message (exit 2)
#     instead of trying `pip install jax[cuda12]`.
#   * that Python also has jaxagent's runtime deps (numpy, flax, optax, orbax-checkpoint,
#     pyyaml); the repo itself is put on PYTHONPATH (no `pip install -e .`). Checked first.
#   * W6_ALLOW_CPU=1 lets the probe pass on a CPU-only JAX: to try this script anywhere
#     (with --small), never for figures.
#   * the JAX there may be newer than the venv's pin: the env record says which version ran.
#   * MFU and the decode's bandwidth are against the matmul and copy peaks measured in the
#     same process (the calib part); datasheet figures appear only for a known device kind
#     (H100, H200), in fields named nominal_*.
# Environment set: XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 (JAX's default pool is 75 % of HBM;
# the update's memory settings are checked against this limit), and
# XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true only if a probe shows this XLA
# accepts it (an unknown flag aborts XLA) and XLA_FLAGS was not already set.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

if [ -n "${W6_PYTHON:-}" ]; then
  PY=$W6_PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY=$VIRTUAL_ENV/bin/python
elif [ -x .venv/bin/python ]; then
  PY=$PWD/.venv/bin/python
else
  PY=python3
fi
echo "w6: using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))" >&2
if [ -n "${W6_OUT:-}" ]; then
  OUTFILE=$W6_OUT
elif [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  OUTFILE=$OUT/w6_gpu.jsonl
else
  OUTFILE=benchmarks/results/w6_gpu.jsonl
fi
LOG=${OUTFILE%.jsonl}.log
mkdir -p "$(dirname "$OUTFILE")"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}

probe() {  # GPU backend present, one kernel runs, jaxagent imports
  timeout -k 5 120 "$PY" - <<'EOF'
import os
import sys
import jax
import jax.numpy as jnp
devs = jax.devices()
print(f"probe: jax {jax.__version__}, devices {devs}", file=sys.stderr)
if devs[0].platform != "gpu" and os.environ.get("W6_ALLOW_CPU") != "1":
    sys.exit(f"probe: JAX has no GPU backend here (platform {devs[0].platform!r}); install a CUDA "
             "build of JAX (jax[cuda12] / jax-cuda13-plugin) for this Python, or set W6_PYTHON")
jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()
import jaxagent.rollout  # noqa: E402,F401
import jaxagent.train  # noqa: E402,F401
EOF
}

GPU_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"
if [ -z "${XLA_FLAGS+x}" ]; then
  if XLA_FLAGS="$GPU_FLAGS" probe; then
    export XLA_FLAGS="$GPU_FLAGS"
  elif probe; then
    echo "note: this XLA rejected '$GPU_FLAGS'; running without XLA flags" >&2
  else
    echo "error: no usable GPU JAX with '$PY' (see the probe's message above); nothing was run" >&2
    exit 2
  fi
elif ! probe; then
  echo "error: no usable GPU JAX with '$PY' and XLA_FLAGS='$XLA_FLAGS'; nothing was run" >&2
  exit 2
fi

# the probes took SECONDS already: the benchmark's budget (and its watchdog, 30 s after it)
# and the hard timeout count from now, so the whole command stays under ~590 s
BUDGET=$(( ${W6_BUDGET_S:-550} - SECONDS ))
HARD=$(( 595 - SECONDS ))
echo "w6: $PY, XLA_FLAGS='${XLA_FLAGS:-}', budget ${BUDGET}s, writing $OUTFILE and $LOG" >&2
timeout -k 5 "$HARD" "$PY" benchmarks/w6_gpu.py --budget-s "$BUDGET" --out "$OUTFILE" "$@" 2> >(tee "$LOG" >&2)
rc=$?
echo "w6: exit $rc; results in $OUTFILE" >&2
exit $rc
