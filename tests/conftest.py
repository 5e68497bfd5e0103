"""Test set-up shared by the whole suite.

Eight virtual CPU devices so mesh/sharding tests run on one CPU machine; silent
rank promotion is an error so broadcasting mistakes fail loudly.

Compilations are cached on disk for the session (a fresh directory each run, removed
at exit; subprocesses such as the CLI tests inherit it through the environment): many
tests build trainers of the same tiny shapes, and a cache hit skips XLA's compilation
of an identical program. This cut about a quarter of the suite's time on 2 cores. Set
JAXAGENT_TEST_JIT_CACHE=0 to run without it.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ.get("JAXAGENT_TEST_JIT_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="jaxagent-test-jit-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# XLA's backend (LLVM) optimisation off: the suite's programs are tiny, so most of their
# time is compilation, and level 0 cut a trainer test file's CPU time by a quarter.
# Results are compared against NumPy references with tolerances, or between programs
# compiled the same way; JAXAGENT_TEST_XLA_OPT=1 keeps XLA's default optimisation.
if os.environ.get("JAXAGENT_TEST_XLA_OPT", "0") != "1" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

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
    trainer = Trainer(config(run_dir, *VARIED, "iterations=2", "logging.episodes_per_iteration=6"), log=lambda *_: None)
    params = host(trainer.state.params)
    trainer.run()
    return types.SimpleNamespace(
        run_dir=run_dir, params_before=params, last_episodes=trainer.last_episodes, trainer=trainer
    )
