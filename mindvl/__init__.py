"""mindvl: train multimodal LLMs the way the MindVL paper does."""

__version__ = "0.1.0"
