"""Models in plain PyTorch: they know nothing of files, YAML or distributed state."""

from .attention import BACKENDS, attend, available_backends
from .config import MindVLConfig, TextConfig, VisionConfig
from .mllm import LossOutput, MindVL, MindVLOutput, mrope_position_ids
from .projector import Projector
from .text import TextModel
from .vision import VisionTransformer

__all__ = [
    "BACKENDS",
    "LossOutput",
    "MindVL",
    "MindVLConfig",
    "MindVLOutput",
    "Projector",
    "TextConfig",
    "TextModel",
    "VisionConfig",
    "VisionTransformer",
    "attend",
    "available_backends",
    "mrope_position_ids",
]
