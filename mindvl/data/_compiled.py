"""The float32 patch expansion as one compiled pass (numba, the optional `fast` extra): the same bits as numpy.

numpy's `expand_patches` makes five passes over the float rows (cast, divide, subtract, divide, copy onto both
temporal slots); this kernel reads each uint8 value once and writes its two float32 copies, 2-3x faster. The
arithmetic is the same float32 `(x / 255 - mean) / std` (no multiply-add to contract, so no fused rounding), and a
test compares it with the numpy path on every level and channel. Without numba, or with MINDVL_DATA_NUMPY=1, the
numpy path runs. numba is imported on first use, not with mindvl.data (its import alone takes a large fraction of
a second).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np


def available() -> bool:
    return os.environ.get("MINDVL_DATA_NUMPY", "") in ("", "0") and _numba_installed()


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _expand_rows(patches, mean, std, out):  # patches [P, C*196] uint8, mean/std [C] float32, out [P, C*2*196] f32
    pixels = patches.shape[1] // mean.shape[0]  # 196 values of one channel's 14x14 patch
    scale = np.float32(255)
    for i in range(patches.shape[0]):
        for c in range(mean.shape[0]):
            m, s = mean[c], std[c]
            first = c * 2 * pixels  # the channel's two temporal slots follow each other
            for j in range(pixels):
                v = (np.float32(patches[i, c * pixels + j]) / scale - m) / s
                out[i, first + j] = v
                out[i, first + pixels + j] = v


@functools.cache
def _kernel():
    import numba

    return numba.njit(cache=True, nogil=True, boundscheck=False)(_expand_rows)


def expand_rows(patches: np.ndarray, mean: np.ndarray, std: np.ndarray, out: np.ndarray) -> None:
    """patches [P, C*196] uint8 -> out [P, C*2*196] float32 (normalised, the frame on both temporal slots)."""
    _kernel()(patches, mean, std, out)
