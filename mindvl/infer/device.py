"""The `--device` of the inference commands (chat, eval, search-resolution, moe-trace), checked before any model is
loaded: a CUDA device on a CPU-only torch build is one line saying so, not torch's AssertionError deep in a
`.to()`."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` (None: cuda when available, else cpu) as a torch.device that this machine has; a ValueError naming
    the device and what to do otherwise."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device {device}: not a device name (cpu, cuda, cuda:1, mps, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"this torch build ({torch.__version__}) has no CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)")
            raise ValueError(f"--device {device}: {why}; use --device cpu, or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu")
    return dev
