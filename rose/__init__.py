"""ROSE: rollout on serving GPUs through co-elasticity.

Lends idle GPU capacity of an LLM serving fleet to agentic-RL rollout, and takes it
back the moment serving latency needs it.
"""

__version__ = "0.1.0"
