"""A decode step's decoder layers run compiled (torch.compile, one layer at a time), so that each step launches
fewer, fused kernels.

    generate(model, prompts, n, compile=True)    # or MINDVL_DECODE_COMPILE=on for every caller that does not choose

Why: at small batch a decode step reads every weight once, and on an accelerator its time is that read plus the
kernels' launch and ramp-up. The eager layer is about 40 kernels (an RMSNorm is eight elementwise kernels, each
rotary embedding five, the SwiGLU product two), and a kernel costs a few microseconds even replayed from a CUDA
graph: a 28-layer 2048-wide model launches about 1,100 per step, milliseconds against the ~0.8 ms its 3.4 GB of
weights take to read on an H200. Inductor fuses each norm, each rotation and the SwiGLU product into one kernel, a
generation's compiled step runs q/k/v and gate/up as one matmul each (fused_projections.py), the step's K/V writes
happen in the kernel that rotates the keys, and each residual add in the kernel of the norm that reads it (the
layer's last one in the next layer's: DecoderLayer.decode_forward); `benchmarks/decode_kernels.py` counts the
launches per step on the CPU: a Qwen2.5-VL decoder layer is 40 eager and 9 compiled (Qwen3's 56 and 9: four
matmuls, the attention, two norms, the rotation with the writes, the SwiGLU product), and the rest of the step 26
and 6.

What is compiled: `layer_forward(fn, ...)`, one function for every layer of every model (and for the step's rotary
tables and final norm: TextModel.forward's `layer_call`). The weights are inputs, so the layers of one kind (dense,
MoE, linear attention) share their compiled graphs; dynamo's guards tell the kinds and the models apart. The cache
is a compile boundary (`LayerKV.decode_target`, `attend`, `attend_latent`, `states` run eagerly): its host state
(the step's plan, the bound, the layer's index) never enters a graph, so nothing recompiles per layer or per step,
and the attention keeps its own backend choice (sdpa, flash-attn's cache kernel). Only tensors cross it: a GQA
layer asks for this step's K/V buffers and slots first and writes them in its graph (kv_cache.store; inductor
writes in place, in the rotation's kernel). A layer is a few graphs, split at the cache's calls. A
second batch size (a compaction, another call) recompiles once with a dynamic batch (dynamo's automatic dynamic
shapes). With `graphs` the compiled layers are captured like eager ones: the capture's warm-up run compiles them.
The layers' methods are shared by every model, so a process decoding several models keeps more graphs per method
than dynamo's default recompile limit of 8, past which it would run them eagerly: the limit is raised
(mindvl.compile_limit).

Numerics: the matmuls are the same library calls as eager. Inductor evaluates a fused elementwise chain without
rounding between its ops unless told to, and its pattern matcher folds the residual add into the down projection
(one addmm, rounded once where eager rounds twice); INDUCTOR_OPTIONS turns both back to eager's roundings, and on
the CPU a bf16 decode step's logits are then bit-identical to eager's (tests/test_decode_compile.py, with inductor;
`benchmarks/decode_kernels.py --check-bits`; inductor's defaults change 80% of them). On a GPU a fused reduction
(the norms' mean of squares) may still sum in another order than eager's kernel, so bf16 tokens could leave the
eager path's after a near tie. That is why it is off by default until the accelerator proof's generate section
(`graphs_compiled`: `identical`, `common_prefix`) says so on the device. The other CI tests compile with a backend
that keeps eager's ops (BACKEND = "aot_eager"): the compiled path's mechanics, quickly.

A compilation that fails (a graph inductor cannot lower, no C++ compiler or triton) turns compilation off for that
step with a warning and the generation runs eagerly: the first compiled step of a model at each batch size (what
makes dynamo compile again) runs once as a trial, its effect on the cache undone; `passed_trial` remembers the
(model, batch) pairs whose trial passed, so later calls skip it, and a model whose trial failed is not compiled
again in this process (`failed_trial`: one warning, not one failed compilation per call).
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable

import torch

from ..compile_limit import make_room_for_graphs

# What `compile=None` means when MINDVL_DECODE_COMPILE is unset (see the module docstring: off until a device run).
COMPILE_BY_DEFAULT = False
COMPILE_ENV = "MINDVL_DECODE_COMPILE"
# torch.compile's backend for the layers: inductor (fused kernels); tests on the CPU use "aot_eager" (the same
# aten ops as eager, traced: the compiled path's mechanics without code generation).
BACKEND: str | Callable = "inductor"
# Eager's numerics, kept (benchmarks/decode_kernels.py --check-bits): `emulate_precision_casts` rounds to bf16
# between fused ops where eager does; the pattern matcher off keeps inductor from rewriting mm + add (the residual
# after down_proj) into one addmm that rounds once where eager rounds twice. The `eager_numerics` pair is for
# triton (no effect on the CPU's C++ kernels): fp32 x / y rounded as eager's division (div_rn, not triton's
# approximate div.full: the norms' mean is one) and subnormals kept rather than flushed to zero, as eager's CUDA
# kernels do. The accelerator proof's decode_bits section measures each piece's bits with and without them.
INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "pattern_matcher": False,
                    "eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True}
# Older names of an option (inductor renamed them): the first one this torch has is passed.
OPTION_ALIASES = {"eager_numerics.division_rounding": ("emulate_divison_rounding",)}

_CALLS: dict = {}
# model -> {(backend, batch size): whether that trial step compiled}
_TRIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def passed_trial(model, batch: int) -> bool:
    """Whether a trial step of this model at this batch size already ran compiled with BACKEND."""
    return _TRIALS.get(model, {}).get((BACKEND, batch), False)


def failed_trial(model) -> bool:
    """Whether a trial step of this model failed to compile with BACKEND (its steps then run eagerly)."""
    return any(not ok for (backend, _), ok in _TRIALS.get(model, {}).items() if backend == BACKEND)


def note_trial(model, batch: int, compiled: bool) -> None:
    _TRIALS.setdefault(model, {})[(BACKEND, batch)] = compiled


def layer_forward(fn, *args):
    """The function dynamo compiles: one decoder layer, or the rotary tables, or the final norm (TextModel.forward's
    `layer_call`)."""
    return fn(*args)


def _kind(fn) -> str:
    """What a piece is (DecoderLayer, RMSNorm, rotary_tables, ...): each kind is compiled as its own function."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _forward_for(kind: str) -> Callable:
    """A copy of `layer_forward` with code of its own. Dynamo keeps a function's graphs with its code, at most
    `recompile_limit` (8) of them, after which it runs the function eagerly; one shared code for the rotary tables,
    the norm and every layer kind (dense, MoE, linear attention), each static and then with a dynamic batch, would
    reach that."""
    code = layer_forward.__code__.replace(co_name=f"decode_{kind}")
    return types.FunctionType(code, layer_forward.__globals__, code.co_name)


def inductor_options(wanted: dict) -> dict:
    """`wanted` (option -> value, dotted names for sub-configs) as this torch's inductor names them: an option
    under an older name (OPTION_ALIASES) renamed, one it does not have left out (an unknown one fails the
    compilation)."""
    from torch._inductor import config

    def known(name: str) -> bool:
        head, _, rest = name.partition(".")
        return hasattr(config, head) and (not rest or hasattr(getattr(config, head), rest))

    out = {}
    for name, value in wanted.items():
        found = next((n for n in (name, *OPTION_ALIASES.get(name, ())) if known(n)), None)
        if found is not None:
            out[found] = value
    return out


def _options() -> dict | None:
    """INDUCTOR_OPTIONS as this torch's inductor names them (inductor_options); None for other backends."""
    return inductor_options(INDUCTOR_OPTIONS) if BACKEND == "inductor" else None


def layer_call() -> Callable[..., torch.Tensor]:
    """The compiled `layer_call` for BACKEND, made once per backend (dynamo keeps its graphs with the compiled
    functions' code, so every step and every model share them): each kind of piece goes to its own compiled copy of
    `layer_forward`."""
    make_room_for_graphs()
    call = _CALLS.get(BACKEND)
    if call is None:
        options, backend = _options(), BACKEND
        compiled: dict[str, Callable] = {}

        def call(fn, *args):
            kind = _kind(fn)
            if kind not in compiled:
                compiled[kind] = torch.compile(_forward_for(kind), backend=backend, options=options)
            return compiled[kind](fn, *args)

        _CALLS[BACKEND] = call
    return call


# (BACKEND, fn) -> fn compiled whole, or None once its compilation failed (then it runs eagerly in this process)
_WHOLE: dict = {}


def whole(fn: Callable) -> Callable | None:
    """fn compiled in one graph with BACKEND (fullgraph: a call runs compiled code or raises one of dynamo's errors
    before running any of it, so a caller may fall back to fn on the same inputs); None if an earlier compilation
    of fn failed."""
    key = (BACKEND, fn)
    if key not in _WHOLE:  # here, not on every call: a generation asks for fn at each decode step
        make_room_for_graphs()
        _WHOLE[key] = torch.compile(fn, backend=BACKEND, options=_options(), fullgraph=True)
    return _WHOLE[key]


def why(error: BaseException) -> str:
    """A failed compilation's cause in one line: the backend's own error (dynamo wraps it), without dynamo's
    advice on debugging it."""
    while (inner := error.__cause__ or getattr(error, "inner_exception", None)) is not None:
        error = inner
    text = " ".join(str(error).split()).split(" Set TORCHDYNAMO_VERBOSE")[0]
    return f"{type(error).__name__}: {text[:300]}"


def whole_failed(fn: Callable, error: BaseException) -> None:
    """fn's compilation failed (`whole`): one warning, and fn runs eagerly from now on with this BACKEND."""
    warnings.warn(f"{fn.__name__} not compiled ({why(error)}); running it eagerly from now on", stacklevel=3)
    _WHOLE[(BACKEND, fn)] = None
