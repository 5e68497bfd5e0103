"""Test set-up shared by the whole suite.

Eight virtual CPU devices so mesh/sharding tests run on one CPU machine; silent
rank promotion is an error so broadcasting mistakes fail loudly.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def stored_run(tmp_path_factory):
    """A tiny real run of 2 iterations with an episode store of 6 episodes each (the
    VARIED env of test_train_loop), shared by the store's and the viewer's tests: its
    directory, the parameters iteration 1 played and scored with (no warm start), the
    last iteration's episodes and the trainer."""
    import types

    from test_train_loop import VARIED, config
    from train_testlib import host
    from jaxagent.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("stored") / "run"
    trainer = Trainer(config(run_dir, *VARIED, "iterations=2", "logging.episodes_per_iteration=6"),
                      log=lambda *_: None)
    params = host(trainer.state.params)
    trainer.run()
    return types.SimpleNamespace(run_dir=run_dir, params_before=params, last_episodes=trainer.last_episodes,
                                 trainer=trainer)
