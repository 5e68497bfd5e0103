"""W8 a whole GRPO iteration (tiny-qwen2): jaxagent's Trainer vs Tunix's GRPOLearner, one run.

Workload (benchmarks/README.md, W8): W1's tiny-qwen2 weights (vocab 4096, hidden 256,
4 layers, 4 heads / 2 KV heads of dim 64, intermediate 1024, untied, N(0, 0.02) with
q/k/v biases, float32; `init_params(key(0))`). 16 prompts of 64 random token ids
(`numpy.random.default_rng(seed).integers(1, 4096)`, the same prompts every iteration),
2 samples each (batch 32), 128 new tokens at temperature 1.0, no early stop (the EOS id
is outside the vocabulary); a random reward per sample (uniform [0, 1)); GRPO advantages;
old-policy and reference log-probs; KL to the reference (k3, beta 0.04) in the loss, clip
0.2, AdamW lr 1e-5 (optax's default weight decay 1e-4), global-norm clip 1.0, one optimizer
step per iteration.
Figure: tokens/s of whole iterations = 32 * 192 / median iteration seconds, after one
warm-up iteration (`--warmup`), median of `--repeats` (default 5).

Systems, loaded from one safetensors file (so their weights are the same bits):
  jaxagent  `jaxagent.train.trainer.Trainer.iteration_step`, the trainer's own per-iteration
            code, unchanged: the rollout (`collect_batch` -> the agent loop's `run`),
            `Placement.logprobs` for the old policy and the KL reference,
            `shape_rewards` + `compute_advantages` (the registered "grpo" estimator),
            one `train_step` (registered "ppo" loss, clip 0.2 / 0.2, no dual clip,
            token-mean, `kl_coef` 0.04 `kl_kind` "k3"; AdamW 1e-5, clip 1.0), the metrics
            fetched to the host. The only stand-in is the agent loop, since W8 has no
            env: `PromptRollout.run` plays the task's prompt with the project's
            `Sampler` (prefill with `append`, then `decode` of 128 tokens at temperature
            1.0 with no stop token), brings tokens and log-probs to the host, and packs
            the one-turn episodes into a `Trajectory` as `AgentLoop` does. Each timed
            iteration ends when the new params are ready (`block_until_ready`).
            Phases (`time_rollout_s`, `time_logprobs_s`, `time_advantages_s`,
            `time_update_s`) are the trainer's own iteration metrics, as it measures
            them: its log-prob phase ends when the old-policy pass is done, so the rest of
            the reference pass (dispatched asynchronously) falls in "advantages";
            `logprobs_plus_advantages` is their sum.
  tunix     `tunix.rl.grpo.grpo_learner.GRPOLearner.train` (package google-tunix) on an
            `RLCluster` with the vanilla rollout, actor, reference and rollout on one
            (1, 1) mesh (so the rollout shares the actor's weights), `GRPOConfig(
            num_generations=2, num_iterations=1, beta=0.04, epsilon=0.2,
            kl_loss_mode="low_var_kl" (= k3), loss_agg_mode="token-mean")`,
            `RolloutConfig(max_tokens_to_generate=128, max_prompt_length=64,
            kv_cache_size=192, temperature=1.0, top_p=1.0)` (top_p set: without it Tunix
            decodes greedily), optimizer optax clip_by_global_norm(1.0) + adamw(1e-5),
            one step per global step (batch 16 prompts x 2). Prompts go in as text through
            a whitespace id tokenizer (Tunix's sampler takes strings); its EOS and pad
            ids are outside the vocabulary, so every completion has 128 tokens (checked)
            and no token is masked. The reward function returns uniform random numbers.

Alternation: Tunix's loop pulls one batch from its data iterator per iteration, and the
iterator given to it runs one jaxagent iteration inside each pull. So the systems
alternate at iteration granularity in one process (jaxagent, Tunix, jaxagent, Tunix,
...): a Tunix iteration is the time from the end of one pull to the start of the next
(its rollout, reference log-probs, rewards and advantages, update, its host loop and
metrics); at each pull the Tunix actor's params are waited for before the clock stops,
so none of its device work leaks into the jaxagent iteration that follows. Tunix runs
one extra, untimed iteration at the end (its loop stops only after `max_steps`).

Differences that stay, because they are how each system works:
  - Tunix with `num_iterations=1` skips the old-policy log-prob pass (its loss uses the
    stop-gradient of the current log-probs as "old"); the jaxagent trainer always runs
    it (one more forward pass of the batch), as it does in training.
  - Tunix's loss materialises the full [B, 128, V] logits and always computes the
    per-token entropy; jaxagent computes log-probs and entropy (a metric) in chunks,
    over all 192 positions (the loss mask selects the completion).
  - Tunix's rollout, reference pass and update go through its own host loop (a data
    thread, a queue, metric buffers); jaxagent's through `Trainer.iteration_step`
    (its iteration metrics included).
  - Tunix's sampler seeds every rollout with the same key (`RolloutConfig.seed` None ->
    PRNGKey(0)); the trainer draws a new sampling seed each iteration.
  - AdamW weight decay: optax's default 1e-4 in both, but jaxagent decays only kernels
    and embeddings (not norms and biases).

Checks before timing: jaxagent's params loaded from the file equal W1's `init_params`;
the completion log-probs of the batch's prompts + random completions under jaxagent's
policy, Tunix's actor and Tunix's reference agree (`max_abs_logp_diff_*` < 1e-3). After the
run: every completion of both systems has 128 tokens and the two samples of each prompt
differ (it samples).

    python benchmarks/w8_iteration.py [--quick] [--repeats 5] [--systems jaxagent,tunix]
                                      [--out benchmarks/results/w8_iteration.jsonl]

A peer that is not installed is reported as a `{"kind": "skipped", ...}` line. The ratio
line has `jaxagent_over_tunix_tokens_per_s` (of the two medians) and
`pairwise_ratio_median` (the median over the alternated pairs of Tunix seconds over
jaxagent seconds: less sensitive to load that drifts during the run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _jsonl import emit  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from w1_generate import _IdTokenizer  # noqa: E402  (token ids as decimal words, as in W1)

from jaxagent import models as M  # noqa: E402

W8 = M.DecoderConfig(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    qkv_bias=True,
    model_type="qwen2",
)
CLIP, BETA, LR, MAX_GRAD_NORM, WEIGHT_DECAY = 0.2, 0.04, 1e-5, 1.0, 1e-4  # optax.adamw's default decay
SYSTEMS = ("jaxagent", "tunix")


# ---------------------------------------------------------------- jaxagent
@dataclasses.dataclass
class _Episode:
    """The fields of `rollout.Episode` the trainer reads from a one-turn episode."""

    index: int
    seed: int
    group_id: int
    success: bool = False
    failed: bool = False
    failure_kind: str = ""
    invalid_actions: int = 0
    noop_actions: int = 0
    done: bool = True
    info: dict = dataclasses.field(default_factory=dict)


class PromptRollout:
    """Stands in for `AgentLoop` in `Trainer.iteration_step` (W8 has no env).

    Task seed `s` plays prompt `prompts[s % len(prompts)]`: one turn of `new_tokens`
    tokens sampled by the project's `Sampler` (prefill, then the on-device decode loop;
    no stop token, so every row runs to the limit), rewarded with a uniform random
    number from `default_rng(sampling seed)`. Returns a `Trajectory` packed as
    the agent loop's episodes are (`jaxagent.rollout.episode.pack`: tokens, masks,
    log-probs brought to the host and back).
    """

    def __init__(self, params, model_config, prompts: np.ndarray, new_tokens: int, sampling):
        from jaxagent.rollout import Sampler

        self.prompts, self.new_tokens, self.sampling = prompts, new_tokens, sampling
        self.max_len = prompts.shape[1] + new_tokens
        self.sampler = Sampler(params, model_config, max_len=self.max_len, min_bucket=prompts.shape[1], pad_id=0)
        self.config = dataclasses.make_dataclass("LoopConfig", [("sampling", object)])(sampling)
        self.last_num_tokens = None
        self.last_tokens = None

    def set_params(self, params) -> None:
        self.sampler.params = params

    def run(self, pool, seeds, group_ids=None, *, seed=None, sampling=None, row_offset=0):
        from jaxagent.rollout import Trajectory
        from jaxagent.rollout.trajectory import rewards_at_turn_ends

        B, P, N, T = len(seeds), self.prompts.shape[1], self.new_tokens, self.max_len
        prompts = [self.prompts[int(s) % len(self.prompts)].tolist() for s in seeds]
        state = self.sampler.init_state(B, int(seed), row_ids=np.arange(B) + int(row_offset))
        state = self.sampler.append(state, prompts)
        _, gen = self.sampler.decode(state, max_new_tokens=N, sampling=sampling or self.sampling)
        toks, logps, num = jax.device_get((gen.tokens_BxN, gen.logprobs_BxN, gen.num_tokens_B))
        self.last_num_tokens, self.last_tokens = np.asarray(num), np.asarray(toks)
        reward = np.random.default_rng(int(seed)).random(B).astype(np.float32)

        tokens = np.zeros((B, T), np.int32)
        tokens[:, :P], tokens[:, P:] = np.asarray(prompts, np.int32), toks
        loss = np.zeros((B, T), np.float32)
        logp = np.zeros((B, T), np.float32)
        tid = np.full((B, T), -1, np.int32)
        valid = np.arange(N)[None, :] < num[:, None]
        loss[:, P:], logp[:, P:], tid[:, P:] = valid, np.where(valid, logps, 0.0), np.where(valid, 0, -1)
        lengths = (P + num).astype(np.int32)
        attn = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
        turn_rew = reward[:, None]
        traj = Trajectory(
            tokens=jnp.asarray(tokens),
            attention_mask=jnp.asarray(attn),
            loss_mask=jnp.asarray(loss),
            rollout_logp=jnp.asarray(logp),
            turn_ids=jnp.asarray(tid),
            rewards=jnp.asarray(rewards_at_turn_ends(turn_rew, tid)),
            group_ids=jnp.asarray(np.asarray(group_ids, np.int32)),
            turn_rewards=jnp.asarray(turn_rew),
            turn_mask=jnp.ones((B, 1), bool),
            anchor_ids=jnp.full((B, 1), -1, jnp.int32),
            episode_return=jnp.asarray(reward),
            lengths=jnp.asarray(lengths),
            num_turns=jnp.ones((B,), jnp.int32),
            done=jnp.ones((B,), bool),
            truncated=jnp.zeros((B,), bool),
            failed=jnp.zeros((B,), bool),
        )
        episodes = [
            _Episode(index=i, seed=int(s), group_id=int(g), success=bool(reward[i] > 0.5))
            for i, (s, g) in enumerate(zip(seeds, group_ids, strict=True))
        ]
        return traj, episodes


def jaxagent_system(model_dir: Path, prompts: np.ndarray, group: int, new_tokens: int, run_dir: Path, seed: int = 0):
    """`(trainer, loop, iteration)`: `iteration()` runs one whole trainer iteration and
    returns `(seconds, metrics)`."""
    from jaxagent.rollout import SamplingConfig
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.config.algo import AlgoSection
    from jaxagent.train.config.env import EnvSection
    from jaxagent.train.config.model import ModelSection
    from jaxagent.train.config.rollout import RolloutSection
    from jaxagent.train.config.run import LoggingSection
    from jaxagent.train.config.step import LossSection, OptimizerConfig
    from jaxagent.train.config.update import UpdateSection
    from jaxagent.train.trainer import Trainer

    n_prompts, P = prompts.shape
    cfg = TrainerConfig(
        model=ModelSection(path=str(model_dir), tokenizer="byte"),
        env=EnvSection(group_size=group, tasks_per_iteration=n_prompts, num_workers=0),
        rollout=RolloutSection(
            max_turns=1, max_tokens_per_turn=new_tokens, max_context=P + new_tokens, temperature=1.0
        ),
        algo=AlgoSection(advantage="grpo"),
        loss=LossSection(
            policy_loss="ppo",
            clip_low=CLIP,
            clip_high=CLIP,
            clip_c=None,
            agg_mode="token-mean",
            kl_coef=BETA,
            kl_kind="k3",
        ),
        optim=OptimizerConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM, weight_decay=WEIGHT_DECAY),
        update=UpdateSection(epochs=1, mini_batches=1, micro_batches=1),
        iterations=1000,
        seed=seed,
        run_dir=str(run_dir),
        logging=LoggingSection(
            tensorboard=False, progress=False, transcripts_every=0, episodes_per_iteration=0, collapse_entropy=0.0
        ),
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    loop = PromptRollout(
        trainer.placement.sampler_params(trainer.state),
        trainer.model_config,
        prompts,
        new_tokens,
        SamplingConfig(temperature=1.0),
    )

    def iteration():
        t = time.perf_counter()
        metrics = trainer.iteration_step(loop, None)
        jax.block_until_ready(trainer.state.params)
        return time.perf_counter() - t, metrics

    return trainer, loop, iteration


def jaxagent_logprobs(trainer, tokens: np.ndarray) -> np.ndarray:
    """The trainer's log-prob pass (old policy) of `tokens` `[B, T]`: `[B, T]`."""
    from jaxagent.train.placement import policy_logprobs

    sc = trainer.config.step_config
    out = policy_logprobs(
        trainer.state.params,
        trainer.model_config,
        tokens_BxT=jnp.asarray(tokens),
        attention_mask_BxT=jnp.ones(tokens.shape, jnp.int32),
        temperature=1.0,
        seq_chunk=sc.seq_chunk,
        vocab_chunk=sc.vocab_chunk,
    )
    return np.asarray(out)


# ---------------------------------------------------------------- Tunix
def tunix_system(model_dir: Path, prompts: np.ndarray, group: int, new_tokens: int, max_steps: int):
    """`(learner, rl_cluster, completions)`: a `GRPOLearner` ready to `train`, and the list
    its reward function appends each batch's completions (texts) to."""
    import optax
    from tunix.models.qwen2 import model as tmodel
    from tunix.models.qwen2 import params as tparams
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    tcfg = tmodel.ModelConfig(
        num_layers=W8.num_layers,
        vocab_size=W8.vocab_size,
        embed_dim=W8.hidden_size,
        hidden_dim=W8.intermediate_size,
        num_heads=W8.num_heads,
        head_dim=W8.head_dim,
        num_kv_heads=W8.num_kv_heads,
        rope_theta=int(W8.rope_theta),
        norm_eps=W8.rms_norm_eps,
        use_tied_embedding=False,
    )
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1]
    )
    actor = tparams.create_model_from_safe_tensors(str(model_dir), tcfg, mesh=mesh, dtype=jnp.float32)
    reference = tparams.create_model_from_safe_tensors(str(model_dir), tcfg, mesh=mesh, dtype=jnp.float32)
    P = prompts.shape[1]
    R = rl_cluster_lib.Role
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), optax.adamw(LR)),
        eval_every_n_steps=10**9,
        max_steps=max_steps,
    )  # no metrics_logging_options: no logging backend
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens,
        max_prompt_length=P,
        kv_cache_size=P + new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=_IdTokenizer(W8.vocab_size),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={R.ACTOR: mesh, R.REFERENCE: mesh, R.ROLLOUT: mesh},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training,
            rollout_config=rollout,
        ),
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=group,
        num_iterations=1,
        beta=BETA,
        epsilon=CLIP,
        kl_loss_mode="low_var_kl",
        loss_agg_mode="token-mean",
    )
    seen: list[list[str]] = []
    rng = np.random.default_rng(12345)

    def random_reward(prompts, completions, **kwargs):  # Tunix passes both by keyword
        seen.append(list(completions))
        return rng.random(len(completions)).tolist()

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=random_reward)
    return learner, cluster, seen


def tunix_logprobs(cluster, tokens: np.ndarray, prompt_len: int) -> dict[str, np.ndarray]:
    """Completion log-probs `[B, T - prompt_len]` of `tokens` under Tunix's actor (its
    rollout model, shared with the trainer) and its reference model."""
    pad, eos = cluster.rollout.pad_id(), cluster.rollout.eos_id()
    p, c = jnp.asarray(tokens[:, :prompt_len]), jnp.asarray(tokens[:, prompt_len:])
    return {
        "actor": np.asarray(cluster.rollout.get_per_token_logps(p, c)),
        "reference": np.asarray(cluster.get_ref_per_token_logps(p, c, pad, eos)),
    }


# ---------------------------------------------------------------- main
def parse_systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise SystemExit(f"w8_iteration: unknown system(s) {unknown or text!r}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def _median(xs):
    return statistics.median(xs) if xs else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="4 prompts x 2 samples of 16 + 16 tokens, 2 timed iterations: a smoke run"
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed iterations per system (default 5; quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    ap.add_argument("--systems", default="jaxagent,tunix", help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' default_rng seed")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args(argv)
    wanted = parse_systems(args.systems)
    n_prompts, G, P, N = (4, 2, 16, 16) if args.quick else (16, 2, 64, 128)
    B, T = n_prompts * G, P + N
    repeats = args.repeats or (2 if args.quick else 5)
    warmup = max(0, args.warmup)
    n_iter = warmup + repeats
    common = {
        "workload": "W8",
        "prompts": n_prompts,
        "samples_per_prompt": G,
        "batch": B,
        "prompt_len": P,
        "new_tokens": N,
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "warmup": warmup,
        "repeats": repeats,
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
    }

    prompts = np.random.default_rng(args.seed).integers(1, W8.vocab_size, (n_prompts, P)).astype(np.int32)
    tmp = tempfile.TemporaryDirectory(prefix="w8_")
    tmpdir = Path(tmp.name)
    params = M.init_params(jax.random.key(0), W8, std=0.02)  # W1's weights
    model_dir = tmpdir / "tiny-qwen2"
    M.save_pretrained(M.Model(params, W8), model_dir, overwrite=True)

    jx = tx = None
    if "jaxagent" in wanted:
        t = time.perf_counter()
        trainer, loop, jax_iteration = jaxagent_system(model_dir, prompts, G, N, tmpdir / "jaxagent_run", args.seed)
        same = jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), params, trainer.state.params
        )
        assert all(jax.tree.leaves(same)), "jaxagent's params loaded from the file differ from W1's init_params"
        jx = {
            "trainer": trainer,
            "loop": loop,
            "iteration": jax_iteration,
            "times": [],
            "metrics": [],
            "num_tokens": [],
            "groups_differ": [],
        }
        print(f"# jaxagent: set up in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    if "tunix" in wanted:
        try:
            import tunix  # noqa: F401
        except ImportError as e:  # a peer that is not installed is skipped, not fatal
            emit({**common, "kind": "skipped", "system": "tunix", "reason": f"not installed: {e}"}, args.out)
        else:
            from importlib.metadata import version

            t = time.perf_counter()
            learner, cluster, completions = tunix_system(model_dir, prompts, G, N, n_iter + 1)
            tx = {
                "learner": learner,
                "cluster": cluster,
                "completions": completions,
                "enter": [],
                "exit": [],
                "rollout_s": [],
            }
            common["tunix"] = version("google-tunix")
            gen = cluster.generate

            def timed_generate(*a, **k):  # Tunix's rollout returns host tokens: it has finished on return
                t0 = time.perf_counter()
                out = gen(*a, **k)
                tx["rollout_s"].append(time.perf_counter() - t0)
                return out

            cluster.generate = timed_generate
            print(f"# tunix: set up in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    if jx is None and tx is None:
        raise SystemExit("w8_iteration: no system to run")

    # ---- checks before timing: the same weights give the same log-probs
    if jx is not None and tx is not None:
        # the iteration's shapes (B rows of P + N tokens), so these compilations are the ones the passes reuse
        rng = np.random.default_rng(args.seed + 1)
        seq = np.concatenate(
            [np.repeat(prompts, G, axis=0), rng.integers(1, W8.vocab_size, (B, N)).astype(np.int32)], axis=1
        )
        ours = jaxagent_logprobs(jx["trainer"], seq)[:, P:]
        theirs = tunix_logprobs(tx["cluster"], seq, P)
        diffs = {k: float(np.max(np.abs(v - ours))) for k, v in theirs.items()}
        emit(
            {
                **common,
                "kind": "check",
                "what": "completion log-probs of the prompts + random completions",
                "first_logp_jaxagent": float(ours[0, 0]),
                "first_logp_tunix_actor": float(theirs["actor"][0, 0]),
                "max_abs_logp_diff_tunix_actor": diffs["actor"],
                "max_abs_logp_diff_tunix_reference": diffs["reference"],
            },
            args.out,
        )
        assert max(diffs.values()) < 1e-3, f"jaxagent and Tunix disagree on log-probs: {diffs}"

    # ---- alternate: one jaxagent iteration inside each of Tunix's data-iterator pulls
    # an array, not a list: Tunix repeats each prompt with np.repeat over the batch's leaves
    batch = {"prompts": np.array([" ".join(map(str, row)) for row in prompts.tolist()])}

    def jax_step():
        secs, metrics = jx["iteration"]()
        jx["times"].append(secs)
        jx["metrics"].append(metrics)
        num = jx["loop"].last_num_tokens
        jx["num_tokens"].append((int(num.min()), int(num.max())))
        toks = jx["loop"].last_tokens.reshape(n_prompts, G, N)
        jx["groups_differ"].append(float(np.mean([len({r.tobytes() for r in g}) == G for g in toks])))

    def pulls():
        from flax import nnx

        for k in range(n_iter + 1):
            jax.block_until_ready(nnx.state(tx["cluster"].actor_trainer.model))  # Tunix's last update is done
            tx["enter"].append(time.perf_counter())
            if jx is not None and k < n_iter:
                jax_step()
            tx["exit"].append(time.perf_counter())
            yield dict(batch)

    t_run = time.perf_counter()
    if tx is not None:
        tx["learner"].train(pulls())
    else:
        for _ in range(n_iter):
            jax_step()
    run_s = time.perf_counter() - t_run
    load_end = round(os.getloadavg()[0], 2)

    # ---- results
    rates = {}
    if jx is not None:
        timed = jx["times"][warmup:]
        med = statistics.median(timed)
        rates["jaxagent"] = B * T / med
        ms = jx["metrics"][warmup:]
        phases = {k: _median([m[f"time_{k}_s"] for m in ms]) for k in ("rollout", "logprobs", "advantages", "update")}
        phases["logprobs_plus_advantages"] = _median([m["time_logprobs_s"] + m["time_advantages_s"] for m in ms])
        phases["other"] = _median(
            [
                t - sum(m[f"time_{k}_s"] for k in ("rollout", "logprobs", "advantages", "update"))
                for t, m in zip(timed, ms, strict=True)
            ]
        )
        lo = min(a for a, _ in jx["num_tokens"])
        hi = max(b for _, b in jx["num_tokens"])
        assert lo == hi == N, f"jaxagent completions have {lo}..{hi} tokens, not {N}"
        emit(
            {
                **common,
                "kind": "iteration",
                "system": "jaxagent",
                "tokens_per_s": round(rates["jaxagent"], 1),
                "median_iteration_s": round(med, 4),
                "iteration_s": [round(x, 4) for x in jx["times"]],
                "warmup_s": [round(x, 3) for x in jx["times"][:warmup]],
                "phase_median_s": {k: round(v, 4) for k, v in phases.items()},
                "completion_tokens_min": lo,
                "completion_tokens_max": hi,
                "groups_with_distinct_samples": _median(jx["groups_differ"]),
                "loss_first": ms[0]["loss"] if ms else None,
                "kl_last": jx["metrics"][-1].get("kl"),
                "grad_norm_first": jx["metrics"][0].get("grad_norm"),
                "skipped_updates": sum(m["skipped_updates"] for m in jx["metrics"]),
                "rollout_logp_gap": _median([m["rollout_logp_gap"] for m in jx["metrics"]]),
                "loadavg_1m_end": load_end,
                "run_s": round(run_s, 2),
            },
            args.out,
        )
    if tx is not None:
        its = [tx["enter"][j + 1] - tx["exit"][j] for j in range(n_iter)]
        timed = its[warmup:]
        med = statistics.median(timed)
        rates["tunix"] = B * T / med
        lens = [len(c.split()) for batch_c in tx["completions"] for c in batch_c]
        differ = [
            float(np.mean([len(set(cs[i * G : (i + 1) * G])) == G for i in range(n_prompts)]))
            for cs in tx["completions"]
        ]
        assert min(lens) == max(lens) == N, f"Tunix completions have {min(lens)}..{max(lens)} tokens, not {N}"
        emit(
            {
                **common,
                "kind": "iteration",
                "system": "tunix",
                "tokens_per_s": round(rates["tunix"], 1),
                "median_iteration_s": round(med, 4),
                "iteration_s": [round(x, 4) for x in its],
                "warmup_s": [round(x, 3) for x in its[:warmup]],
                "rollout_median_s": round(_median(tx["rollout_s"][warmup:n_iter]), 4),
                "completion_tokens_min": min(lens),
                "completion_tokens_max": max(lens),
                "groups_with_distinct_samples": _median(differ),
                "iterations_run": len(tx["completions"]),
                "loadavg_1m_end": load_end,
                "run_s": round(run_s, 2),
            },
            args.out,
        )
    if len(rates) == 2:
        # each timed jaxagent iteration against the Tunix iteration that ran right after it
        pairs = [t / j for j, t in zip(jx["times"][warmup:], its[warmup:], strict=True)]
        emit(
            {
                **common,
                "kind": "ratio",
                "numerator": "jaxagent",
                "denominator": "tunix",
                "jaxagent_over_tunix_tokens_per_s": round(rates["jaxagent"] / rates["tunix"], 3),
                "pairwise_ratio_median": round(statistics.median(pairs), 3),
                "pairwise_ratios": [round(x, 3) for x in pairs],
                "alternated": "per iteration",
                "loadavg_1m_end": load_end,
            },
            args.out,
        )
    tmp.cleanup()


if __name__ == "__main__":
    main()
