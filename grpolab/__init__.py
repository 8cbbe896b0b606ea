"""grpolab: reinforcement learning from verifiable rewards (GRPO and the methods it is measured against)."""

__version__ = "0.1.0"
