"""jaxagent: a JAX trainer for multi-turn reinforcement learning of LLM agents.

Subpackages are imported on demand (``jaxagent.algos`` stands alone, so importing it
never pulls in the models, rollout or trainer).
"""

__version__ = "0.1.0"

#: the environment variable that makes the kernels take another platform's code paths on
#: whatever backend runs them: "cpu", "gpu" or "tpu" (tests run the accelerator paths,
#: the sampler's layer scan and GAE without the CPU's native kernel, on the CPU with "gpu")
CODE_PATHS_ENV = "JAXAGENT_CODE_PATHS"
_CODE_PATHS = ("cpu", "gpu", "tpu")


def code_platform() -> str:
    """The platform whose code paths the kernels choose where a platform decides one
    (the sampler's unrolled decode on CPU, GAE's native kernel on CPU): `$JAXAGENT_CODE_PATHS`
    when set, else `jax.default_backend()`."""
    import os

    want = os.environ.get(CODE_PATHS_ENV, "").strip().lower()
    if not want:
        import jax

        return jax.default_backend()
    if want not in _CODE_PATHS:
        raise ValueError(f"${CODE_PATHS_ENV}={want!r}: expected one of {', '.join(_CODE_PATHS)} (or unset)")
    return want
