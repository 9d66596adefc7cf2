"""The training planner: the recipe's real model, `parallelize` and training step on a simulated cluster (fake
process group, fake tensors), memory traced per rank; FLOPs, communication and step time estimated per device."""

from .devices import DEVICES, Device, get_device, known_devices
from .planner import PlanResult, format_report, headline, model_config, plan, verdict
from .presets import known_presets, preset_config

__all__ = ["DEVICES", "Device", "PlanResult", "format_report", "get_device", "headline", "known_devices",
           "known_presets", "model_config", "plan", "preset_config", "verdict"]
