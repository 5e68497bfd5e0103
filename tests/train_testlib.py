"""Shared helpers for the training tests."""

import jax
import jax.numpy as jnp
import numpy as np


def host(tree):
    """A host copy (NumPy; PRNG keys as key data) to compare against after donation."""

    def leaf(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)

    return jax.tree.map(leaf, tree)
