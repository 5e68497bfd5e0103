"""Test set-up shared by the whole suite.

Eight virtual CPU devices so mesh/sharding tests run on one CPU machine; silent
rank promotion is an error so broadcasting mistakes fail loudly.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
