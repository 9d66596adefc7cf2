"""Golden values from transformers' own Qwen2-VL video processor, run in a subprocess by test_data_video.py.

torchvision is not installed beside this torch (it breaks imports), and the processor module imports it only for
its resize and normalize kernels. A stub stands in for torchvision at import time; this script then calls the
processor's pure parts: `sample_frames`, the size decision inside `resize` (the torchvision call itself is
intercepted), `_fuse_mean_std_and_rescale_factor` and `patchify`. Input: a JSON file of cases; output: JSON.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Any:
    """Stands in for any torchvision attribute that transformers touches at import time."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Any(f"{self._name}.{item}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"torchvision stub: {self._name} was called")

    def __repr__(self):
        return f"<stub {self._name}>"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        def attr(item, n=spec.name):
            if item.startswith("__"):
                raise AttributeError(item)
            return _Any(f"{n}.{item}")

        m.__getattr__ = attr
        if spec.name == "torchvision":
            m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass



def main(case_file: str) -> None:
    sys.meta_path.insert(0, _Finder())  # only in this subprocess
    import json

    import numpy as np
    import torch
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    cases = json.loads(open(case_file).read())
    proc = Qwen2VLVideoProcessor()
    out: dict = {"defaults": {"min_frames": proc.min_frames, "max_frames": proc.max_frames,
                              "min_pixels": proc.size["shortest_edge"], "max_pixels": proc.size["longest_edge"],
                              "max_video_tokens": proc.max_video_tokens, "temporal_patch": proc.temporal_patch_size}}
    out["indices"] = [
        proc.sample_frames(VideoMetadata(total_num_frames=c["total"], fps=c["video_fps"]), fps=c["fps"],
                           min_frames=c.get("min_frames"), max_frames=c.get("max_frames")).tolist()
        for c in cases["sampling"]
    ]
    # The size decision: intercept the torchvision resize that follows it.
    parent = type(proc).__mro__[1]
    parent.resize = lambda self, image, size, resample=None, **kw: (size.height, size.width)
    out["sizes"] = [
        list(proc.resize(torch.zeros(1, c["frames"], 3, c["height"], c["width"], dtype=torch.uint8), proc.size,
                         None, factor=28, temporal_factor=2, cap_pixels_per_frame=c["cap"]))
        for c in cases["sizes"]
    ]
    frames = torch.from_numpy(np.load(cases["frames_npy"]))  # [n, H, W, 3] uint8, already at the target size
    video = frames.permute(0, 3, 1, 2)[None].to(torch.float32)  # [1, n, 3, H, W]
    mean, std, _ = proc._fuse_mean_std_and_rescale_factor(True, proc.image_mean, proc.image_std, True,
                                                          proc.rescale_factor, video.device)
    video = (video - mean[:, None, None]) / std[:, None, None]  # torchvision's normalize: sub, then div
    rows, t, h, w = proc.patchify(video, patch_size=14, merge_size=2, temporal_patch_size=2)
    np.save(cases["rows_npy"], rows[0].numpy())
    out["grid"] = [t, h, w]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
