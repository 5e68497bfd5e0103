"""Reading collectives out of compiled HLO text (`jitted.lower(...).compile().as_text()`),
for the sharding tests (`test_parallel_collectives.py`).

`collectives(text)` lists every collective of the program with its result bytes and
how often it runs per execution of the program; `loop_collectives(text)` those that run
inside the top-level while loops (per iteration of such a loop: the sampler's decode
loop runs one iteration per token). A collective inside a nested loop (the layer scan)
counts as many times as that loop's `known_trip_count` says (1 when XLA gives none).

`compile_text(lowered)` compiles a program here and now (never from the persistent
compilation cache) and returns what XLA logged on stderr too, and the program as XLA's
partitioner left it when asked (`gradient_all_reduces` reads that one).

Run as a script, it prints one JSON line per mesh (fsdp=8, data=8, 2x2x2; 8 CPU devices):
the collectives per decode token of the sampler's decode loop (the layer-scan path), the
train step's collectives, its weight-sized gradient all-reduces and how many are sliced
to the device's shard, and XLA's rematerialization warnings while compiling the decode,
the append and the train step (the figures of docs/guides/scaling.md). `--before`
emulates the code before the sampler had rules of its own::

    .venv/bin/python tests/hlo_testlib.py [--before] [--vocab 97]
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import tempfile

#: the collective ops counted (async pairs are counted by their `-start` half)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its op (`all-gather`, ...), the computation it is in,
    the bytes and element counts of its result arrays, and how many times it runs per
    run of the unit asked for (a whole program, or one iteration of a top-level loop)."""

    op: str
    name: str
    computation: str
    result_bytes: int
    result_elements: tuple[int, ...]
    times: int
    line: str

    @property
    def largest_result(self) -> int:
        """Elements of its largest result array (a variadic all-reduce has several)."""
        return max(self.result_elements, default=0)


@dataclasses.dataclass
class _Instr:
    name: str
    type: str
    op: str
    rest: str
    line: str


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str]:
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        head = _COMP_HEAD.match(line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append(_Instr(m.group(1), m.group(2), m.group(3), m.group(4), line.strip()))
    if entry is None:
        raise ValueError("hlo: no ENTRY computation in the text (pass `compiled.as_text()`)")
    return comps, entry


def _arrays(type_str: str) -> list[tuple[str, int]]:
    out = []
    for dtype, dims in _ARRAY.findall(type_str):
        if dtype not in _DTYPE_BYTES:
            continue
        out.append((dtype, math.prod(int(d) for d in dims.split(",") if d) if dims else 1))
    return out


def _called(instr: _Instr) -> list[str]:
    names = _CALLED.findall(instr.rest)
    for group in _CALLED_LIST.findall(instr.rest):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def _trip_count(instr: _Instr) -> int:
    m = _TRIP.search(instr.rest)
    return int(m.group(1)) if m else 1


def _op_of(instr: _Instr) -> str | None:
    for op in COLLECTIVES:
        if instr.op == op or instr.op == op + "-start":
            return op
    return None


def _walk(comps, name: str, times: int, out: list[Collective], stack: tuple = ()) -> None:
    if name in stack or name not in comps:
        return
    for ins in comps[name]:
        op = _op_of(ins)
        if op is not None:
            arrays = _arrays(ins.type)
            if ins.op.endswith("-start") and op == "all-gather" and len(arrays) > 1:
                arrays = arrays[len(arrays) // 2 :]  # (operands, results) of an async all-gather
            out.append(
                Collective(
                    op,
                    ins.name,
                    name,
                    sum(n * _DTYPE_BYTES[d] for d, n in arrays),
                    tuple(n for _, n in arrays),
                    times,
                    ins.line,
                )
            )
        inner = times * _trip_count(ins) if ins.op == "while" else times
        for callee in _called(ins):
            _walk(comps, callee, inner, out, stack + (name,))


def collectives(text: str) -> list[Collective]:
    """Every collective of the compiled program, `times` = runs per program run."""
    comps, entry = _parse(text)
    out: list[Collective] = []
    _walk(comps, entry, 1, out)
    return out


def loop_collectives(text: str) -> list[Collective]:
    """The collectives inside the program's top-level while loops (body and condition,
    and everything they call), `times` = runs per iteration of that loop. The sampler's
    decode program has one top-level loop per attention-window segment, one iteration
    per sampled token; its layer scan is a nested loop."""
    comps, entry = _parse(text)
    out: list[Collective] = []
    loops = [ins for ins in comps[entry] if ins.op == "while"]
    if not loops:
        raise ValueError("hlo: the entry computation has no while loop")
    for ins in loops:
        for callee in _called(ins):
            _walk(comps, callee, 1, out, (entry,))
    return out


def summary(found: list[Collective]) -> dict[str, dict[str, int]]:
    """{op: {"count": runs, "bytes": result bytes moved}} (each instruction times its runs)."""
    table: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in found:
        table[c.op]["count"] += c.times
        table[c.op]["bytes"] += c.times * c.result_bytes
    return dict(sorted(table.items()))


def per_loop_iteration(text: str) -> dict[str, dict[str, int]]:
    """`summary` of one iteration of each top-level loop, averaged over those loops
    (the decode loop's segments are the same loop on growing windows)."""
    comps, entry = _parse(text)
    loops = [ins for ins in comps[entry] if ins.op == "while"]
    table = summary(loop_collectives(text))
    return {op: {k: v // len(loops) for k, v in row.items()} for op, row in table.items()}


# ----------------------------------------------------------------------------- compiling
#: what XLA's SPMD partitioner logs (on stderr, from C++) when two shardings of an array
#: conflict so that it replicates the whole array and slices it again
REMAT_WARNING = "Involuntary full rematerialization"


@contextlib.contextmanager
def captured_stderr():
    """Captures file descriptor 2 (XLA's C++ logging) into `out["text"]`."""
    sys.stderr.flush()
    saved = os.dup(2)
    out: dict[str, str] = {}
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out["text"] = f.read().decode(errors="replace")


def compile_text(lowered, dump_passes: str | None = None) -> tuple[str, str, dict[str, str]]:
    """`(hlo, stderr, dumps)`: a lowered program compiled here and now (a dump directory in
    its compiler options keeps it from being served by the persistent compilation cache,
    so XLA's partitioner really runs and logs), its compiled HLO text, what XLA printed on
    stderr meanwhile, and the HLO dumped after the passes matching `dump_passes` (file
    name -> text; e.g. "spmd-partitioning": the program just partitioned, before XLA's
    CPU passes fuse it)."""
    with tempfile.TemporaryDirectory() as d:
        opts = {"xla_dump_to": d}
        if dump_passes:
            opts["xla_dump_hlo_pass_re"] = dump_passes
        with captured_stderr() as err:
            compiled = lowered.compile(compiler_options=opts)
        dumps = {}
        if dump_passes:
            for name in os.listdir(d):
                if name.endswith(".txt") and ".after_" in name:
                    with open(os.path.join(d, name)) as f:
                        dumps[name] = f.read()
    return compiled.as_text(), err["text"], dumps


def gradient_all_reduces(partitioned_text: str, min_elements: int) -> list[tuple[str, list[str]]]:
    """The all-reduces of at least `min_elements` elements of a program just partitioned
    (`compile_text(..., "spmd-partitioning")`'s dump), each with the instructions that use
    its result (through `_PASS_THROUGH` ops). Under fsdp XLA reduces a weight's gradient as
    all-reduce + dynamic-slice to the device's shard; XLA's GPU and TPU compilers turn that
    pair into one reduce-scatter (`ReduceScatterCreator`), XLA:CPU leaves it as it is."""
    comps, _ = _parse(partitioned_text)
    users: dict[str, list[_Instr]] = collections.defaultdict(list)
    found = []
    for instrs in comps.values():
        for ins in instrs:
            for operand in re.findall(r"%([\w.\-]+)", ins.rest.split("),")[0]):
                users[operand].append(ins)
            if _op_of(ins) == "all-reduce" and max((n for _, n in _arrays(ins.type)), default=0) >= min_elements:
                found.append(ins.name)

    def final_users(name: str) -> list[_Instr]:
        out = []
        for u in users[name]:
            out += final_users(u.name) if u.op in _PASS_THROUGH else [u]
        return out

    return [(name, final_users(name)) for name in found]


#: ops that pass a value on unchanged (a variadic all-reduce's parts; the copy a sharding
#: constraint leaves behind), followed to the ops that really use it
_PASS_THROUGH = ("get-tuple-element", "copy", "bitcast")


def instruction(text: str, name: str) -> _Instr:
    """The instruction `name` of an HLO text."""
    comps, _ = _parse(text)
    for instrs in comps.values():
        for ins in instrs:
            if ins.name == name:
                return ins
    raise KeyError(f"hlo: no instruction {name!r}")


def elements(instr: _Instr) -> int:
    """Elements of an instruction's (largest) result array."""
    return max((n for _, n in _arrays(instr.type)), default=0)


# ----------------------------------------------------------------------------- the programs
def decoder_test_config(vocab_size: int = 128):
    """The small decoder of the collective tests: every weight matrix of a layer (the
    smallest is `k_proj`'s 64 x 32) is larger than a decode step's activations and
    logits at 8 rows, so a collective at least that size moves weights. The vocabulary
    (128) divides over "tensor", so the embedding and the lm_head are split there too."""
    from jaxagent.models import tiny_config

    return tiny_config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
    )


def smallest_weight_matrix(config) -> int:
    """Elements of the smallest weight matrix of one decoder layer."""
    D, q, kv, F = (
        config.hidden_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
        config.intermediate_size,
    )
    return min(D * q, D * kv, q * D, D * F, F * D)


def decode_lowered(sampler, rows: int = 8, max_new_tokens: int = 2):
    """`sampler`'s decode for `rows` rows (greedy), lowered."""
    import numpy as np

    from jaxagent.rollout import SamplingConfig

    state = sampler.init_state(rows)
    args = (
        sampler._put_rows(np.ones(rows, bool)),
        sampler._put_rows(np.full(rows, max_new_tokens, np.int32)),
        sampler._put_rows(np.full((rows, 1), -1, np.int32)),
        sampler._put_rows(np.full((rows, 1, 1), -1, np.int32)),
    )
    return sampler._decode.lower(
        sampler.params, state, *args, sampling=SamplingConfig(0.0), max_new_tokens=max_new_tokens
    )


def append_lowered(sampler, rows: int = 8, tokens: int = 16):
    """`sampler`'s append of `tokens` tokens to `rows` rows (a prefill), lowered."""
    import numpy as np

    ids = sampler._put_rows(np.zeros((rows, tokens), np.int32))
    return sampler._append.lower(sampler.params, sampler.init_state(rows), ids, ids)


def train_step_lowered(mesh, config=None, rows: int = 16, seq: int = 16, micro_batches: int = 1):
    """The sharded train step (`make_update_step`) on `mesh`, lowered."""
    import jax
    import numpy as np

    from jaxagent import models as M
    from jaxagent import parallel as par
    from jaxagent.train.config.step import StepConfig
    from jaxagent.train.update import make_update_step
    from jaxagent.train.update.batch import UpdateBatch
    from jaxagent.train.update.state import init_train_state

    config = config or decoder_test_config()
    step_cfg = StepConfig(num_micro_batches=micro_batches)
    state = init_train_state(jax.random.key(0), M.init_params(jax.random.key(0), config), config, step_cfg)
    state = par.shard_train_state(state, mesh)
    step = make_update_step(step_cfg, state, mesh)
    z = np.zeros((rows, seq), np.float32)
    batch = par.shard_batch(
        UpdateBatch(tokens=np.zeros((rows, seq), np.int32), loss_mask=z, advantages=z, old_logp=z), mesh
    )
    return step.lower(state, batch)


def main() -> None:
    """The before/after figures (module docstring). `--before` emulates the code before the
    sampler had rules of its own: the sampler on the training rules, and the embedding
    lookup on the table as the update lays it out (no `embed_table` constraint)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--before", action="store_true")
    ap.add_argument("--vocab", type=int, default=128)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAXAGENT_CODE_PATHS"] = "gpu"  # the accelerators' decode: the layer scan
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from jaxagent import models as M
    from jaxagent import parallel as par
    from jaxagent.models import decoder
    from jaxagent.rollout import Sampler

    kw = {}
    if args.before:
        kw["rules"] = par.LOGICAL_AXIS_RULES
        decoder.ACTIVATION_AXES["embed_table"] = ("vocab", "embed")  # the table's own layout: no constraint
    cfg = decoder_test_config(args.vocab)
    params = M.init_params(jax.random.key(0), cfg)
    weight = smallest_weight_matrix(cfg)
    for shape in ((1, 8, 1), (8, 1, 1), (2, 2, 2)):
        mesh = par.make_mesh(par.MeshConfig(*shape))
        sampler = Sampler(params, cfg, max_len=64, window_segments=1, mesh=mesh, **kw)
        assert not sampler.unroll_layers
        text, err, _ = compile_text(decode_lowered(sampler))
        _, err_append, _ = compile_text(append_lowered(sampler))
        big = [c for c in loop_collectives(text) if c.op == "all-gather" and c.largest_result >= weight]
        train, err_train, dumps = compile_text(train_step_lowered(mesh, cfg), "spmd-partitioning")
        partitioned = next(t for n, t in dumps.items() if "after_spmd-partitioning" in n)
        ars = gradient_all_reduces(partitioned, weight)
        print(
            json.dumps(
                {
                    "mesh": "x".join(map(str, shape)),
                    "vocab": args.vocab,
                    "code": "before" if args.before else "after",
                    "decode_per_token": per_loop_iteration(text),
                    "decode_weight_sized_all_gathers_per_token": sum(c.times for c in big),
                    "train_step": summary(collectives(train)),
                    "train_weight_sized_all_reduces": len(ars),
                    "train_weight_sized_all_reduces_sliced_to_shards": sum(
                        bool(us) and all(u.op == "dynamic-slice" for u in us) for _, us in ars
                    ),
                    "remat_warnings": {
                        "decode": err.count(REMAT_WARNING),
                        "append": err_append.count(REMAT_WARNING),
                        "train_step": err_train.count(REMAT_WARNING),
                    },
                }
            )
        )


if __name__ == "__main__":
    main()
