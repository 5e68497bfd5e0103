#!/usr/bin/env bash
# The turn-credit comparison on the intake recipe: GRPO (episode-level group baseline)
# against turn_loo (a turn-level leave-one-out baseline) and turn_gae (a turn-level
# critic), from the same warm start, at the same budget (ITERATIONS, default 10,
# iterations x 64 interviews), three seeds, held-out evaluation every 10 iterations on the
# recipe's 128 cases.
#
# It needs the three GRPO runs of the recipe first:
#   jaxagent train --config configs/intake.yaml seed=S run_dir=runs/intake_sS   (S = 0 1 2)
# Their step-0 checkpoint (the warm start) is exported once (runs/intake_wsS) and each
# arm starts from it, so the arms differ in the estimator only. The recipe's learning
# rate is constant after its warm-up, so the GRPO runs' first ITERATIONS iterations are
# the GRPO arm at this budget (their evaluation at that iteration is the comparison's).
#   bash examples/intake_turn_credit.sh [SEEDS...]     (default: 0 1 2)
#   the figure: python examples/intake_curves.py turn-credit ... --out docs/assets/intake_turn_credit.png
#   (its docstring has the full command)
set -euo pipefail
JAXAGENT=${JAXAGENT:-jaxagent}
SEEDS=${*:-0 1 2}
ITERATIONS=${ITERATIONS:-10}
for s in $SEEDS; do
  if [ ! -d "runs/intake_s$s/checkpoints/0" ]; then
    echo "runs/intake_s$s/checkpoints/0 is missing: train the recipe's seed $s first" >&2; exit 2
  fi
  [ -f "runs/intake_ws$s/model.safetensors" ] || "$JAXAGENT" export "runs/intake_s$s" "runs/intake_ws$s" --step 0 --overwrite
done
for s in $SEEDS; do
  for arm in loo:turn_loo gae:turn_gae; do
    name=${arm%%:*}; estimator=${arm#*:}
    [ -f "runs/intake_${name}_s$s/summary.json" ] && continue
    "$JAXAGENT" train --config configs/intake.yaml model.path="runs/intake_ws$s" model.tokenizer=null \
      warm_start=null algo.advantage="$estimator" iterations="$ITERATIONS" seed="$s" run_dir="runs/intake_${name}_s$s"
  done
done
