"""jaxagent: a JAX trainer for multi-turn reinforcement learning of LLM agents.

Subpackages are imported on demand (``jaxagent.algos`` stands alone, so importing it
never pulls in the models, rollout or trainer).
"""

__version__ = "0.1.0"
