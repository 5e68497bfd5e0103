"""LoRA from the training config (`model.lora`): only the adapters train (the base weights
stay bitwise as they started), their optimizer state is the adapters'
alone, the KL reference holds a copy of the adapters only and reads the base from the
policy's own weights, and a LoRA run resumes exactly."""

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxagent import models as M
from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
LORA = [
    "model.lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, up_proj]}",
    "loss.kl_coef=0.05",
    "optim.lr=1e-2",
    "env.num_workers=0",
    "rollout.max_context=256",
    "env.name=testing/faulty",
    "env.kwargs={horizon: 2}",
]


def config(run_dir, *extra):
    return load_config(TrainerConfig, CONFIG, [f"run_dir={run_dir}", *LORA, *extra])


def test_lora_run_trains_the_adapters_only_with_an_adapter_reference(tmp_path):
    trainer = Trainer(config(tmp_path / "run", "iterations=2"), log=lambda *_: None)
    assert trainer.model_config.lora == M.LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"))
    before = jax.device_get(trainer.state.params)
    adapters, frozen = M.split_lora(before)
    # the reference: the adapters' copy, nothing of the base
    ref_leaves = jax.tree.leaves(trainer.ref_params)
    assert len(ref_leaves) == len(jax.tree.leaves(adapters)) == 6
    # optimizer state: the adapters' moments only
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state.opt_state) if hasattr(x, "nbytes"))
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    assert opt_bytes < 2 * adapter_bytes + 1024
    assert trainer.memory_estimate["reference"] == adapter_bytes
    history = trainer.run()
    assert len(history) == 2 and all(np.isfinite(m["kl"]) for m in history)
    after = jax.device_get(trainer.state.params)
    a2, f2 = M.split_lora(after)
    for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(f2), strict=True):
        np.testing.assert_array_equal(x, y)  # the base: bitwise unchanged
    moved = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(a2), strict=True)]
    assert any(moved)  # the B matrices start at 0 and move


@pytest.mark.slow
def test_a_lora_run_resumes_exactly(tmp_path):
    """2 iterations + resume to 3 == 3 in one run (the adapter reference restored from disk)."""
    Trainer(config(tmp_path / "run", "iterations=2"), log=lambda *_: None).run()
    more = Trainer(config(tmp_path / "run", "iterations=3"), resume=True, log=lambda *_: None).run()
    straight = Trainer(config(tmp_path / "b", "iterations=3"), log=lambda *_: None).run()

    def strip(ms):
        return [{k: v for k, v in m.items() if not k.startswith("time_") and k != "tokens_per_s"} for m in ms]

    assert strip(more) == strip(straight)


def test_lora_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="model.lora: LoraConfig.targets has unknown entries"):
        config(tmp_path, "model.lora={rank: 4, targets: [wq]}")
    with pytest.raises(ConfigError, match="model.lora.rnk"):
        config(tmp_path, "model.lora.rnk=4")
