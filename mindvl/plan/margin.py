"""The planner's margin over the traced peak: the reserve and the routing-skew factor, from measurement.

The trace (mindvl.plan.simulate) counts the tensors a step holds, as FSDP2's memory tracker does. What it cannot
see, and the reserve covers, per rank:

    reserve = runtime context + communication buffers + (growth - 1) x (traced peak + routing-skew term)
    growth  = max(1, allocated / planned) x max(1, reserved / allocated)

- runtime context: the CUDA/CANN context and its libraries (memory outside the allocator on one device);
- communication buffers: NCCL/HCCL's per-peer buffers (absent on one device, so a one-GPU run cannot measure them);
- allocated / planned: the allocator's high-water over the planned peak at the same shape (alignment, tensors the
  tracker misses, kernel workspaces); a ratio below 1 (the plan over-counts) earns no credit;
- reserved / allocated: what the caching allocator holds beyond what it handed out at its high-water
  (fragmentation): a GPU's `max_memory_reserved / max_memory_allocated` of the real step.

The numbers live in `margin.json` beside this module, each with where it came from, per device kind:
`reserve_by_device` holds what a GPU proof measured (`python -m mindvl.plan.margin --from-proof OUT/proof.json
--planned-bytes N`, from benchmarks/accelerator_proof.py's output and the planner's peak for the same packs), or
names the measured kind a device borrows and why (`like`); a kind with neither takes `reserve`, the CPU stand-ins
(benchmarks/bench_plan_margin.py: c10's CPU allocator high-water against the plan in one process, and the C library
heap's peak-RSS growth over that high-water, with the stated 1 GiB + 1 GiB fixed parts), and its verdict says the
reserve was not measured there. The communication buffers count only where a rank has peers (world size > 1). The
stated reserve all of this replaced: 2 GiB + 5% of the device's capacity.

Time: `efficiency` lists measured model FLOPs utilisations, each for one device kind and model family
(`model_family`), with its range over the timed steps and its source. The planner's step time is the step's FLOPs
per rank at a measured efficiency of that device kind and family; where none was measured it prints no time.

Routing skew: `routing_skew.factor` is the planner's default capacity factor (mindvl.plan.skew): the busiest EP rank
receives factor x its balanced share of routed rows. Its source is stated in the file: a measured rank-level
factor of a real tiny MoE run (bench_plan_margin.py skew), raised to the capacity factor of Switch Transformer
(Fedus, Zoph, Shazeer 2022, "Switch Transformers", JMLR 23(120), section 2.2: capacity factor 1.25 in training)
when the tiny run measures less: a tiny run on little data is no proof of a 671B router's balance.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .devices import GIB

MARGIN_FILE = Path(__file__).with_name("margin.json")


def stated_reserve_bytes(capacity_bytes: int) -> int:
    """The reserve before it was measured: 2 GiB + 5% of capacity (kept for before/after comparisons)."""
    return int(2 * GIB + 0.05 * capacity_bytes)


@dataclass(frozen=True)
class Margin:
    runtime_context_bytes: int
    comm_buffers_bytes: int
    allocated_over_planned: float
    reserved_over_allocated: float
    skew_factor: float
    sources: dict[str, str]  # where each number came from
    device: str = ""  # the device kind asked for ("" = the file's default reserve)
    measured_on: str = ""  # the device kind whose measurement this is ("" = none: CPU stand-ins)

    @property
    def growth(self) -> float:
        """How much the allocator's footprint exceeds the planned bytes (>= 1: over-counting plans earn no credit)."""
        return max(1.0, self.allocated_over_planned) * max(1.0, self.reserved_over_allocated)

    @property
    def fixed_bytes(self) -> int:
        return self.runtime_context_bytes + self.comm_buffers_bytes

    def reserve_bytes(self, planned_bytes: int, peers: bool = True) -> int:
        """The reserve for a rank whose traced peak (plus routing-skew term) is `planned_bytes`; `peers`: the rank
        has communication peers (world size > 1; one device holds no NCCL/HCCL peer buffers)."""
        fixed = self.fixed_bytes if peers else self.runtime_context_bytes
        return int(fixed + (self.growth - 1.0) * planned_bytes)

    def describe(self, peers: bool = True) -> str:
        where = self.sources.get("measured_on", "?")
        if not self.measured_on:
            origin = f"no reserve measured on {self.device or 'this device kind'}: CPU stand-ins"
        elif self.measured_on != self.device:
            origin = f"{self.device} not measured: {self.measured_on}'s measurement ({self.sources.get('like', '')})"
        else:
            origin = f"measured on {where}"
        fixed = (f"{self.fixed_bytes / GIB:.1f} GiB runtime + comm buffers" if peers else
                 f"{self.runtime_context_bytes / GIB:.1f} GiB runtime (one rank: no comm buffers)")
        return f"{fixed} + {self.growth - 1:.1%} of the peak (allocator growth; {origin}; mindvl/plan/margin.json)"


@dataclass(frozen=True)
class Efficiency:
    """A measured model FLOPs utilisation (the trainer's MFU: counted FLOPs / (step time x peak)) of one device kind
    and model family, with its range over the timed steps."""

    device: str
    family: str
    mfu: float
    low: float
    high: float
    source: str

    def describe(self) -> str:
        return (f"{self.mfu:.1%} MFU ({self.low:.1%}-{self.high:.1%}) measured on {self.device} for {self.family}: "
                f"{self.source}")


_KEYS = {"runtime_context_gib": float, "comm_buffers_gib": float, "allocated_over_planned": float,
         "reserved_over_allocated": float}


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
        raw["reserve"], raw["routing_skew"]  # noqa: B018  (both sections must be there)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a planner margin file ({type(e).__name__}: {e}); restore it from git") from None
    return raw


def _reserve_values(path: Path, where: str, reserve: dict) -> dict[str, float]:
    values = {}
    for key in _KEYS:
        v = reserve.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{path}: {where}.{key} must be a number >= 0, got {v!r}")
        values[key] = float(v)
    return values


def load_margin(path: Path | str | None = None, device: str | None = None) -> Margin:
    """margin.json (or `path`), validated, for `device` (a device kind, mindvl.plan.devices): its own measured
    reserve, the one it is `like`, else the default (CPU stand-ins). A bad file is a one-line error naming the file
    and key."""
    path = Path(path) if path else MARGIN_FILE
    raw = _read(path)
    skew = raw["routing_skew"]
    by_device = raw.get("reserve_by_device") or {}
    where, reserve, measured_on, like = "reserve", raw["reserve"], "", ""
    entry = by_device.get(device) if device else None
    if isinstance(entry, dict) and "like" in entry:
        like = str(entry.get("why", ""))
        measured_on, entry = str(entry["like"]), by_device.get(entry["like"])
        if not isinstance(entry, dict) or "like" in entry:
            raise ValueError(f"{path}: reserve_by_device.{device}.like names no measured device kind")
    if isinstance(entry, dict):
        where, reserve, measured_on = f"reserve_by_device.{measured_on or device}", entry, measured_on or device
    values = _reserve_values(path, where, reserve)
    factor = skew.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"{path}: routing_skew.factor must be a number >= 1 (1 = balanced), got {factor!r}")
    sources = {k: str(v) for k, v in reserve.items() if k not in _KEYS}
    sources["routing_skew"] = str(skew.get("source", ""))
    if like:
        sources["like"] = like
    return Margin(int(values["runtime_context_gib"] * GIB), int(values["comm_buffers_gib"] * GIB),
                  values["allocated_over_planned"], values["reserved_over_allocated"], float(factor), sources,
                  device or "", measured_on)


def load_efficiencies(path: Path | str | None = None) -> list[Efficiency]:
    """margin.json's measured efficiencies (none: an empty list)."""
    path = Path(path) if path else MARGIN_FILE
    out = []
    for i, e in enumerate(_read(path).get("efficiency") or []):
        try:
            eff = Efficiency(str(e["device"]), str(e["family"]), float(e["mfu"]), float(e["mfu_low"]),
                             float(e["mfu_high"]), str(e["source"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: efficiency[{i}] needs device, family, mfu, mfu_low, mfu_high, source "
                             f"({type(exc).__name__}: {exc})") from None
        if not 0 < eff.low <= eff.mfu <= eff.high <= 1:
            raise ValueError(f"{path}: efficiency[{i}] needs 0 < mfu_low <= mfu <= mfu_high <= 1")
        out.append(eff)
    return out


def efficiency_for(device: str, family: str, path: Path | str | None = None) -> Efficiency | None:
    """The measured efficiency of this device kind and model family, if any (never another kind's)."""
    return next((e for e in load_efficiencies(path) if e.device == device and e.family == family), None)


def reserve_from_proof(proof: dict, planned_bytes: int | None = None, planned_how: str = "") -> dict:
    """A measured reserve (margin.json's `reserve_by_device` entry) from benchmarks/accelerator_proof.py's
    proof.json: the real step on the planner's packs (`mindvl.memory_planner_packs`) against the planner's peak for
    them: `planned_bytes` when given (a re-plan of the same recipe, `planned_how` says which), else the proof's own
    `sections.plan` (whose torch may count differently: the H200 proof's torch 2.11 planned 24 B/parameter of
    optimizer state, benchmarks/bench_plan_vs_proof.py re-plans it)."""
    sections = proof.get("sections", {})
    plan = sections.get("plan", {})
    mem = sections.get("mindvl", {}).get("memory_planner_packs") or proof.get("mindvl", {}).get(
        "memory_planner_packs")
    if planned_bytes:
        plan = {"ok": True, "peak_bytes_per_rank": planned_bytes}
    if not plan.get("ok") or not plan.get("peak_bytes_per_rank") or not mem:
        raise ValueError("proof.json: no planner peak and real-step memory of the same packs (sections plan and "
                         "mindvl.memory_planner_packs); run the proof on a GPU with both sections succeeding")
    if proof.get("dry_run"):
        raise ValueError("proof.json: a --dry-run on CPU records no allocator figures; use a GPU run's proof.json")
    device = sections.get("environment", {}).get("gpu") or "a GPU"
    planned, alloc, reserved = plan["peak_bytes_per_rank"], mem["max_allocated_bytes"], mem["max_reserved_bytes"]
    return {
        "runtime_context_gib": round(mem["outside_allocator_bytes"] / GIB, 3),
        "comm_buffers_gib": 1.0,
        "allocated_over_planned": round(alloc / planned, 4),
        "reserved_over_allocated": round(reserved / alloc, 4),
        "measured_on": f"{device} (benchmarks/accelerator_proof.py, the mid-size SFT 8K step on the planner's packs)",
        "runtime_context_source": "measured: device memory in use outside the caching allocator after the step",
        "comm_buffers_source": "stated: NCCL/HCCL per-peer buffers, ~1 GiB; a one-device run has none to measure",
        "allocated_over_planned_source": f"measured: max_memory_allocated {alloc} / planned peak {planned}"
                                         + (f" ({planned_how})" if planned_how else " (the proof's plan section)"),
        "reserved_over_allocated_source": f"measured: max_memory_reserved {reserved} / max_memory_allocated {alloc}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mindvl.plan.margin",
                                description="show the planner's margin, or record a GPU proof's measured reserve")
    p.add_argument("--from-proof", metavar="PROOF_JSON", help="benchmarks/accelerator_proof.py's proof.json")
    p.add_argument("--planned-bytes", type=int, help="the planner's peak for the proof's packs, re-planned (default: "
                                                      "the proof's plan section)")
    p.add_argument("--planned-how", default="", help="where --planned-bytes came from (recorded as its source)")
    p.add_argument("--file", default=str(MARGIN_FILE), help="the margin file to read / update")
    args = p.parse_args(argv)
    try:
        kind = None
        if args.from_proof:
            from .devices import device_for_name

            raw = _read(Path(args.file))
            proof = json.loads(Path(args.from_proof).read_text())
            gpu = proof.get("sections", {}).get("environment", {}).get("gpu") or ""
            known = device_for_name(gpu)
            if known is None:
                raise ValueError(f"{args.from_proof}: environment.gpu {gpu!r} is no device kind the planner knows "
                                 "(mindvl/plan/devices.py)")
            kind = known.name
            raw.setdefault("reserve_by_device", {})[kind] = reserve_from_proof(proof, args.planned_bytes,
                                                                               args.planned_how)
            Path(args.file).write_text(json.dumps(raw, indent=1) + "\n")
        m = load_margin(args.file, kind)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"reserve = {m.describe()}; routing skew factor {m.skew_factor} ({m.sources['routing_skew']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
