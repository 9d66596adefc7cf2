"""Checkpoints: HF import/export (one key table per family, Conv->Matmul), mindvl model folders (sharded safetensors +
config.json: `load_model`, `save_pretrained`)."""

from .adapters import load_model  # a model folder, or an adapter folder merged into its base
from .conv import conv3d_to_matmul, matmul_to_conv3d
from .hf import compose, convert_from_hf, save_pretrained
from .safetensors_io import ShardedWriter, TensorFolder, atomic_output_folder

__all__ = [
    "ShardedWriter",
    "TensorFolder",
    "atomic_output_folder",
    "compose",
    "conv3d_to_matmul",
    "convert_from_hf",
    "load_model",
    "matmul_to_conv3d",
    "save_pretrained",
]
