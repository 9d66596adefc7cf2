"""MoE routing-consistency analysis: router traces, SRP/SCH and expert-cache simulation.

- `trace_io`: the `RouterTrace` container and its `.npz` format (`save_trace`, `load_trace`).
- `metrics`: `srp`, `srp_curve`, `sch` (arXiv 2505.16056, reference semantics of github ljcleo/moe-lrc).
- `cache`: `hit_rate` for the `lru`, `lfu`, `belady`, `fsf` (SCH's look-ahead) and `static` policies.
- `report`: the analysis behind `mindvl moe-analyze` (tables, JSON, plots, cache-size guidance).
- `synthetic`: routing traces with tunable locality, for tests and benchmarks.

Only numpy is needed here; numba (the optional `fast` extra) runs the same computations as compiled kernels
(`_compiled`, about 10x faster). Router tracing (which needs torch) lives in `mindvl.moe_analysis.trace`.
"""

from mindvl.moe_analysis.cache import POLICIES, HitRateResult, hit_rate
from mindvl.moe_analysis.metrics import SRPResult, sch, srp, srp_curve
from mindvl.moe_analysis.trace_io import RouterTrace, load_trace, save_trace

__all__ = [
    "POLICIES", "HitRateResult", "RouterTrace", "SRPResult", "hit_rate", "load_trace", "save_trace", "sch", "srp",
    "srp_curve",
]
