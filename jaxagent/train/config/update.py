"""The run config's `update:` section: epochs, mini- and micro-batches, the log-prob pass
and trimming (`UpdateSection`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from jaxagent.dataclass_yaml import Bound, Bounded

OLD_LOGPROBS = ("recompute", "sampler")


@dataclasses.dataclass(frozen=True)
class UpdateSection(Bounded):
    """How an iteration's batch updates the policy: mini-batches, micro-batches, the
    log-prob pass before the update, and whether the update and that pass are cut to the
    rows' own lengths (the run's builder chooses the update step and the log-prob pass
    from these keys once: `jaxagent.train.build.make_placement`).

    epochs, mini_batches, micro_batches: each iteration's batch of
      `env.group_size * env.tasks_per_iteration` episodes is shuffled and cut into
      `mini_batches` updates, `epochs` times; each mini-batch is accumulated over
      `micro_batches` micro-batches.
    logprob_rows: rows per pass of the log-prob computations over an iteration's batch
      (old policy, KL reference); None = the whole batch in one pass. The passes run in
      turn, so their memory is that of `logprob_rows` rows: set it (a divisor of the batch,
      e.g. the update's micro-batch rows) when the memory check says the log-prob pass
      does not fit. Values agree with one pass to float32 rounding.
    old_logprobs: where the update's old-policy log-probs come from. "recompute" (the
      default): a forward pass of the trainer over the batch before the update, with the
      params that sampled it. "sampler": the sampler's own log-probs of the tokens it drew
      (`rollout_logp`), which are those of the same params and distribution up to float
      rounding (the `rollout_logp_gap` metric of a "recompute" run shows how close), so
      the log-prob pass is skipped: one forward pass over the batch less per iteration.
      It needs untruncated sampling (`rollout.top_k` 0, `rollout.top_p` 1) and no
      `loss.tis_cap` (whose weights compare the two).
    trim_padding: 0 = the log-prob pass and the update see every row padded to
      `rollout.max_context` (they compile once); N > 0 = each iteration's batch is cut to
      its longest episode rounded up to a multiple of N (`jaxagent.rollout.trim_padding`):
      the same losses, computed without the trailing padding, at the cost of one compile
      per distinct length. Worth it when episodes are much shorter than `max_context`.
      With several processes the batches are cut to the longest episode of all of them.
    trim_chunks: with `trim_padding` N > 0, also cut each micro-batch of the update and
      each row chunk of the log-prob pass to its own longest episode (rounded up to a
      multiple of N), the rows grouped by length (`jaxagent.train.update.trimmed.TrimmedUpdate`):
      the same losses (the denominators are the mini-batch's), without the padding of
      rows shorter than the batch's longest. Worth it when episode lengths vary; each
      distinct chunk length compiles once. The log-prob pass runs in chunks of
      `logprob_rows` rows, or of the update's micro-batch rows when that is unset. On a
      mesh (one process or several) data * fsdp must divide a micro-batch's rows: each
      cut micro-batch's rows are split over them, and every process cuts the same
      micro-batches from its copy of the batch.
    """

    epochs: Annotated[int, Bound(ge=1)] = 1
    mini_batches: Annotated[int, Bound(ge=1)] = 1
    micro_batches: Annotated[int, Bound(ge=1)] = 1
    logprob_rows: Annotated[int | None, Bound(ge=1)] = None
    old_logprobs: str = "recompute"
    trim_padding: Annotated[int, Bound(ge=0)] = 0
    trim_chunks: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {list(OLD_LOGPROBS)}, got {self.old_logprobs!r}")
        if not isinstance(self.trim_chunks, bool):
            raise ValueError(f"update.trim_chunks must be true or false, got {self.trim_chunks!r}")
        if self.trim_chunks and not self.trim_padding:
            raise ValueError(
                "update.trim_chunks needs update.trim_padding > 0 (the multiple its chunk lengths "
                "are rounded up to), got update.trim_padding=0"
            )

    def check_batch(self, batch_size: int) -> None:
        """`ValueError` unless the rollout batch of `batch_size` rows splits into
        `mini_batches` mini-batches of `micro_batches` micro-batches, and into passes of
        `logprob_rows` rows."""
        B = batch_size
        if B % self.mini_batches:
            raise ValueError(
                f"update.mini_batches ({self.mini_batches}) must divide the rollout batch "
                f"env.group_size * env.tasks_per_iteration = {B}"
            )
        if (B // self.mini_batches) % self.micro_batches:
            raise ValueError(
                f"update.micro_batches ({self.micro_batches}) must divide the mini-batch size {B // self.mini_batches}"
            )
        if self.logprob_rows is not None and B % self.logprob_rows:
            raise ValueError(
                f"update.logprob_rows ({self.logprob_rows}) must divide the rollout batch "
                f"env.group_size * env.tasks_per_iteration = {B}"
            )

    def micro_batch_rows(self, batch_size: int) -> int:
        """Rows of one micro-batch of the update of a batch of `batch_size` rows."""
        return batch_size // (self.mini_batches * self.micro_batches)


def check_mesh_rows(batch_size: int, mini_batches: int, shards: int) -> None:
    """`ValueError` unless a mini-batch's rows (`batch_size / mini_batches`) split over
    `shards = mesh.data * mesh.fsdp`: the one mesh divisibility check, made on the config
    when its mesh has no -1 axis and on the mesh itself (`jaxagent.train.placement._make_mesh`)."""
    mb = batch_size // mini_batches
    if mb % shards:
        raise ValueError(
            f"mesh: the mini-batch size {mb} (env.group_size * env.tasks_per_iteration / "
            f"update.mini_batches) must be divisible by mesh.data * mesh.fsdp = {shards} (its rows "
            f"are split over them)"
        )
