"""Accelerators the planner knows: memory, peak bf16 FLOP/s, HBM and interconnect bandwidths (public datasheets;
Ascend 910B1/910B2 and the A100 from the MindVL paper's Table 10), or `custom:` with numbers.

    get_device("h100-80g")
    get_device("custom:mem_gb=96,tflops=700,hbm_gbs=4000,intra_gbs=450,inter_gbs=50,per_node=8")

Bandwidths are per device and per direction: `intra_gbs` between devices of a node (NVLink; the 910B relies on
PCIe per the paper), `inter_gbs` between nodes (one NIC per device). Capacities are what the runtime reports as
total device memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # total device memory
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    hbm_bytes_s: float
    intra_bytes_s: float  # per direction, device to device inside a node
    inter_bytes_s: float  # per direction, per device across nodes
    per_node: int = 8

    def to_dict(self) -> dict:
        return asdict(self)


def _dev(name, mem_mib, tflops, hbm_gbs, intra_gbs, inter_gbs, per_node=8) -> Device:
    return Device(name, int(mem_mib * 2**20), tflops * 1e12, hbm_gbs * GB, intra_gbs * GB, inter_gbs * GB, per_node)


DEVICES: dict[str, Device] = {
    # NVLink 4: 900 GB/s bidirectional = 450 per direction; 8 x 400 Gb/s InfiniBand NICs per node
    "h100-80g": _dev("h100-80g", 81559, 989, 3350, 450, 50),
    "h200": _dev("h200", 143771, 989, 4800, 450, 50),
    # NVLink 3: 600 GB/s bidirectional (Table 10) = 300 per direction; 200 Gb/s HDR per GPU
    "a100-80g": _dev("a100-80g", 81920, 312, 2039, 300, 25),
    # Table 10: 64 GB HBM at 1800 GB/s, no NVLink, 64 GB/s PCIe between cards; 200 Gb/s RoCE per NPU
    "910b1": _dev("910b1", 65536, 400, 1800, 32, 25),
    "910b2-64g": _dev("910b2-64g", 65536, 376, 1800, 32, 25),
    # the one-card fine-tuner's 24 GB: RTX 4090 (165 dense bf16 TFLOP/s with fp32 accumulation, 1008 GB/s GDDR6X,
    # PCIe 4.0 x16 between cards, no NVLink)
    "rtx4090-24g": _dev("rtx4090-24g", 24564, 165, 1008, 32, 12.5),
}
ALIASES = {"h100": "h100-80g", "a100": "a100-80g", "910b2": "910b2-64g", "910b1-64g": "910b1"}
_CUSTOM_KEYS = {"mem_gb": "memory", "tflops": "peak", "hbm_gbs": "hbm", "intra_gbs": "intra", "inter_gbs": "inter",
                "per_node": "per node"}


def known_devices() -> str:
    return ", ".join([*DEVICES, "custom:mem_gb=..,tflops=..,hbm_gbs=..,intra_gbs=..,inter_gbs=..[,per_node=8]"])


def get_device(name: str) -> Device:
    key = name.strip().lower()
    if key.startswith("custom:"):
        return _custom(key[len("custom:"):])
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        runtime = device_for_name(name)  # a runtime's own name, e.g. "NVIDIA H100 80GB HBM3"
        if runtime is not None:
            return runtime
        raise ValueError(f"--device: unknown device {name!r}; known: {known_devices()}")
    return DEVICES[key]


def _custom(spec: str) -> Device:
    values: dict[str, float] = {}
    for part in filter(None, spec.split(",")):
        k, _, v = part.partition("=")
        if k not in _CUSTOM_KEYS:
            raise ValueError(f"--device custom: unknown key {k!r}; known: {', '.join(_CUSTOM_KEYS)}")
        try:
            values[k] = float(v)
        except ValueError:
            raise ValueError(f"--device custom: {k}={v!r} is not a number") from None
    missing = [k for k in _CUSTOM_KEYS if k != "per_node" and k not in values]
    if missing:
        raise ValueError(f"--device custom: missing {', '.join(missing)} (e.g. custom:mem_gb=64,tflops=376,"
                         "hbm_gbs=1800,intra_gbs=32,inter_gbs=25)")
    return Device("custom", int(values["mem_gb"] * GB), values["tflops"] * 1e12, values["hbm_gbs"] * GB,
                  values["intra_gbs"] * GB, values["inter_gbs"] * GB, int(values.get("per_node", 8)))


def device_for_name(runtime_name: str) -> Device | None:
    """The table entry for a runtime's device name ("NVIDIA H100 80GB HBM3", "Ascend910B2"), if known."""
    key = runtime_name.replace(" ", "").replace("-", "").upper()
    for marker, name in (("H100", "h100-80g"), ("H800", "h100-80g"), ("H200", "h200"), ("A100", "a100-80g"),
                         ("A800", "a100-80g"), ("910B1", "910b1"), ("910B2", "910b2-64g"),
                         ("4090", "rtx4090-24g")):
        if marker in key:
            return DEVICES[name]
    return None
