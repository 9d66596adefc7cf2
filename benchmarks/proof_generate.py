"""The accelerator proof's `generate` section (issue 39): decode speed of the prepared mid model in bf16.

    python benchmarks/accelerator_proof.py --out $OUT --sections prepare,generate

Kept in its own module so the proof's driver changes by three lines (the section's entry, its worker, its summary
line). Needs `prepare` (the mid model saved as transformers' Qwen2.5-VL and imported by mindvl).

Per batch (1 and 32 on a GPU; 1 and 4 in --dry-run), B text prompts of 128 random tokens (equal lengths, so
transformers needs no padding) and 64 greedy tokens each:
- mindvl `engine="eager"`: the loop before the static cache (reads every step, drops finished rows);
- mindvl static cache, eager kernels (`graphs=False`);
- mindvl static cache with the decode step replayed from a CUDA graph (`graphs=True`; captured by the warm-up
  call and kept for the timed ones, decode_graph.lease);
- the same with the step's decoder layers compiled by inductor (`graphs_compiled`: compile=True,
  mindvl.infer.decode_compile; fused kernels, fewer per step, q/k/v and gate/up one matmul each
  (mindvl.infer.fused_projections), the K/V writes in the rotation's kernel, the greedy tokens picked and recorded
  in 3 kernels (generate.greedy_tokens, compiled whole); counted on the CPU, a layer is 9 kernels against eager's
  40; the warm-up call compiles, `warmup_s` says how long);
- the two static arms again with cuDNN taken out of sdpa's choice (`*_no_cudnn`): on Hopper torch gives bf16 sdpa
  to cuDNN first, whose plans are built per shape (kv_cache.WINDOW_STEP);
- transformers `generate` on the same weights (bf16, its default cache), with torch's default sdpa choice and
  without cuDNN.
`capture` times one short call (2 tokens) with the kept step released (a capture) and again (a replay);
`sdpa` lists the backend torch picks for each attention call of one static call, and the distinct shapes.
`kernels_per_step` counts the device kernels of one decode step (torch.profiler: a 2-token call less a 1-token one)
with the layers eager and compiled, the launches a CUDA graph replays, and names the 12 taking the most time;
`us_per_kernel_beyond_weights` is a graph arm's step time less one read of the weights, per kernel (what fewer
kernels would save). Every mindvl arm should give the eager loop's tokens (`identical`; the compiled arm can leave
them after a near tie, see decode_compile: `common_prefix` says where; `compiled_step_bits` compares the two
steps' logits, teacher-forced, and the fused q/k/v matmul alone); transformers' agreement is reported as the
common prefix (bf16 kernels differ).
Tokens/s is B x 64 / wall time of the call (prefill included); `step_ms` is (wall - prefill) / 63 and
`decode_tokens_per_s` B / step time. The bandwidth bound of a decode step is the language model's weight bytes over
the measured device copy bandwidth (read + write of a 1 GiB buffer): batch 1 cannot beat bw / weight bytes tokens/s,
batch B (KV reads aside) B times that.
"""

from __future__ import annotations

import time
from pathlib import Path


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def copy_bandwidth(device, nbytes: int = 2**30, reps: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read + write)."""
    import torch

    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    seconds, _ = _timed(lambda: [y.copy_(x) for _ in range(reps)], device)
    return 2 * nbytes * reps / seconds


def no_cudnn():
    """sdpa may choose any backend but cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sdpa_choices(fn) -> dict:
    """Run fn() and count, per backend torch's sdpa picks (torch._fused_sdp_choice), the calls, and the distinct
    (query, key, mask) shapes: each new shape is a cuDNN plan build."""
    import collections

    import torch
    from torch.nn.attention import SDPBackend
    from torch.overrides import TorchFunctionMode

    names = {int(getattr(SDPBackend, n).value): n for n in ("ERROR", "MATH", "FLASH_ATTENTION",
                                                            "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}

    class Record(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.shapes = collections.Counter(), collections.defaultdict(set)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", "") == "scaled_dot_product_attention":
                choice = names.get(int(torch._fused_sdp_choice(*args, **kwargs)), "other")
                self.calls[choice] += 1
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                self.shapes[choice].add((tuple(args[0].shape), tuple(args[1].shape),
                                         None if mask is None else tuple(mask.shape)))
            return func(*args, **kwargs)

    with Record() as rec:
        fn()
    return {name: {"calls": n, "distinct_shapes": len(rec.shapes[name])} for name, n in rec.calls.items()}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def sec_generate(args, work: Path, save_partial=None) -> dict:
    """`save_partial(args, data, running)` (the driver's): the figures so far are kept if the section is cut off."""
    import contextlib

    import torch

    from mindvl.checkpoint import load_model
    from mindvl.infer import Prompt, decode_compile, decode_graph, generate

    if not (work / "mindvl").is_dir():
        raise RuntimeError("the generate section needs the prepare section's model (run prepare first)")
    dry = args.dry_run
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not dry else torch.device("cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cpu":  # the dry run checks the arm's code, not inductor's C++ (tens of seconds to compile)
        decode_compile.BACKEND = "aot_eager"
    new, length = (8, 32) if dry else (64, 128)
    batches = (1, 4) if dry else (1, 32)
    t0 = time.perf_counter()
    model = load_model(work / "mindvl", dtype=dtype, device=device).eval()
    out: dict = {"load_s": time.perf_counter() - t0, "dtype": str(dtype), "new_tokens": new, "prompt_tokens": length}
    lm = model.language_model
    out["weights_bytes"] = sum(p.numel() * p.element_size() for p in lm.parameters())
    out["copy_bytes_per_s"] = copy_bandwidth(device, 2**26 if dry else 2**30)
    out["bound_tokens_per_s_batch1"] = out["copy_bytes_per_s"] / out["weights_bytes"]
    vocab = model.config.text.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts_all = [Prompt(torch.randint(0, min(vocab, 150000) - 1000, (length,), generator=gen))
                   for _ in range(max(batches))]

    hf = None
    try:
        from transformers import Qwen2_5_VLForConditionalGeneration

        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(work / "hf", dtype=dtype).to(device).eval()
    except Exception as exc:  # the mindvl arms still count
        out["transformers_error"] = f"{type(exc).__name__}: {exc}"[:500]

    out["batches"] = {}
    for b in batches:
        prompts = prompts_all[:b]
        arms = {"eager": (dict(engine="eager"), contextlib.nullcontext),
                "static": (dict(graphs=False), contextlib.nullcontext),
                "graphs": (dict(graphs=True), contextlib.nullcontext),
                "graphs_compiled": (dict(graphs=True, compile=True), contextlib.nullcontext),
                "static_no_cudnn": (dict(graphs=False), no_cudnn),
                "graphs_no_cudnn": (dict(graphs=True), no_cudnn)}
        row: dict = {}
        tokens: dict[str, list[list[int]]] = {}
        out["batches"][str(b)] = row
        for name, (kw, context) in arms.items():
            if save_partial is not None:
                save_partial(args, out, f"batch {b}, {name}")
            decode_graph.release(model)  # each graphs arm captures under its own sdpa choice
            with context():
                # warm-up (kernels, allocator; the graph capture, kept; the compilation)
                warmup_s, _ = _timed(lambda kw=kw, ps=prompts: generate(model, ps, 2, **kw), device)
                prefill_s, _ = _timed(lambda kw=kw, ps=prompts: generate(model, ps, 1, **kw), device)
                seconds, tokens[name] = _timed(lambda kw=kw, ps=prompts: generate(model, ps, new, **kw), device)
            step_ms = 1000 * (seconds - prefill_s) / (new - 1)
            row[name] = {"s": round(seconds, 4), "tokens_per_s": b * new / seconds, "step_ms": step_ms,
                         "decode_tokens_per_s": b * 1000 / step_ms if step_ms > 0 else None,
                         "warmup_s": round(warmup_s, 3)}
            if name != "eager":
                row[name]["common_prefix"] = min(common_prefix(a, e) for a, e in
                                                 zip(tokens[name], tokens["eager"], strict=True))
            if kw.get("compile"):  # False: the compilation failed and the arm ran eagerly (its warning is logged)
                row[name]["compiled"] = decode_compile.passed_trial(model, b)
        row["identical"] = {name: tokens[name] == tokens["eager"] for name in arms if name != "eager"}
        if b == batches[0]:
            try:  # a diagnosis: its failure must not cost the section's other figures
                row["compiled_step_bits"] = compiled_step_bits(model, prompts, tokens["eager"], min(new, 8))
            except Exception as exc:  # noqa: BLE001
                row["compiled_step_bits"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        if save_partial is not None:
            save_partial(args, out, f"batch {b}, capture, sdpa and transformers")
        decode_graph.release(model)
        first, _ = _timed(lambda ps=prompts: generate(model, ps, 2, graphs=True), device)
        kept, _ = _timed(lambda ps=prompts: generate(model, ps, 2, graphs=True), device)
        row["capture"] = {"first_call_s": first, "kept_call_s": kept, "capture_s": first - kept}
        row["sdpa"] = sdpa_choices(lambda ps=prompts: generate(model, ps, new, graphs=False))
        if device.type == "cuda":
            row["kernels_per_step"] = {
                arm: kernels_per_step(lambda n, kw=kw, ps=prompts: generate(model, ps, n, graphs=False, **kw))
                for arm, kw in (("eager_layers", {}), ("compiled_layers", {"compile": True}))}
        if hf is not None:
            ids = torch.stack([p.input_ids for p in prompts]).to(device)
            kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                      eos_token_id=None, pad_token_id=0)
            for name, context in (("transformers", contextlib.nullcontext), ("transformers_no_cudnn", no_cudnn)):
                with torch.inference_mode(), context():
                    hf.generate(input_ids=ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
                    seconds, seq = _timed(lambda ids=ids, kw=kw: hf.generate(input_ids=ids, **kw), device)
                ref = seq[:, length:].tolist()
                row[name] = {"s": round(seconds, 4), "tokens_per_s": b * new / seconds,
                             "common_prefix_with_eager": min(common_prefix(a, r) for a, r in
                                                             zip(tokens["eager"], ref, strict=True))}
            row["graphs_over_transformers"] = row["graphs"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
            best_hf = max(row["transformers"]["tokens_per_s"], row["transformers_no_cudnn"]["tokens_per_s"])
        weights_ms = 1000 * out["weights_bytes"] / out["copy_bytes_per_s"]  # one read of the weights
        for arm, kernels in (("graphs", "eager_layers"), ("graphs_compiled", "compiled_layers")):
            decode = row[arm]["decode_tokens_per_s"]
            row[f"{arm}_over_bound"] = decode / (b * out["bound_tokens_per_s_batch1"]) if decode else None
            if "kernels_per_step" in row:  # what a replayed kernel costs beyond the weight read, microseconds
                n = row["kernels_per_step"][kernels]["decode_step"]
                row[arm]["us_per_kernel_beyond_weights"] = 1000 * (row[arm]["step_ms"] - weights_ms) / max(n, 1)
            if hf is not None:
                row[f"{arm}_over_best_transformers"] = row[arm]["tokens_per_s"] / best_hf
    return out


def compiled_step_bits(model, prompts, eager_tokens: list[list[int]], steps: int) -> dict:
    """Does compilation keep eager's bits on this device? Teacher-forced: the logits of `steps` decode steps, each
    fed the eager loop's token, with the layers eager and as a compiled generation runs them (fused projections,
    decode_compile's layers): `equal`, `max_abs_diff`, `fraction_differing`, `argmax_differs` (steps whose token
    would differ). `fused_matmul_equal`: the first layer's q/k/v as one matmul against three, alone (whether the
    matmul library picks another kernel for the wider matrix). Run after the compiled arm, so nothing compiles."""
    import torch
    import torch.nn.functional as F

    from mindvl.infer import decode_compile, decode_graph
    from mindvl.infer.fused_projections import fused_projections
    from mindvl.infer.generate import pack_prompts

    device = model.language_model.embed_tokens.weight.device
    packed = pack_prompts(prompts, device)
    # the capacity of the compiled arm's kept cache: nothing recompiles
    capacity = decode_graph.bucket(max(len(p.input_ids) for p in prompts) + steps - 1)

    @torch.inference_mode()
    def logits(call) -> torch.Tensor:
        cache = model.new_kv_cache(len(prompts), capacity)
        out, positions = model.prefill(packed["input_ids"], packed["cu_seqlens"], cache)
        rows = [out.float()]
        for s in range(steps - 1):
            fed = torch.tensor([t[s] for t in eager_tokens], device=device)
            rows.append(model.decode_step(fed, positions + s, cache, layer_call=call).float())
        return torch.stack(rows[1:])

    eager = logits(None)
    with fused_projections(model):
        compiled = logits(decode_compile.layer_call())
    diff = (eager - compiled).abs()
    attn = model.language_model.layers[0].self_attn
    with torch.inference_mode():
        x = torch.randn(len(prompts), attn.q_proj.in_features, dtype=attn.q_proj.weight.dtype, device=device)
        apart = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        bias = (torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
                if attn.q_proj.bias is not None else None)
        together = F.linear(x, weight, bias)
    return {"steps": steps - 1, "equal": bool((diff == 0).all()), "max_abs_diff": diff.max().item(),
            "fraction_differing": (diff > 0).float().mean().item(),
            "argmax_differs": int((eager.argmax(-1) != compiled.argmax(-1)).any(-1).sum()),
            "fused_matmul_equal": torch.equal(apart, together)}


def kernels_per_step(call, top: int = 12, device: str = "cuda") -> dict:
    """Device kernels of one decode step: call(2) (a prefill and one step) less call(1) (the prefill), counted by
    torch.profiler's CUDA activity; `by_kernel`: the step's `top` kernel names by device time (count, microseconds),
    where the next lever is. (`device="cpu"` counts CPU ops instead: how the tests check this function.)"""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU

    def kernels(n: int) -> collections.Counter:
        call(n)  # warm (compilation, allocator)
        with profile(activities=[activity]) as prof:
            call(n)
            if device == "cuda":
                torch.cuda.synchronize()
        found: collections.Counter = collections.Counter()
        for e in prof.events():
            if e.device_type == kind:
                found[(e.name[:90], "n")] += 1
                found[(e.name[:90], "us")] += e.time_range.elapsed_us()
        return found

    one, two = kernels(1), kernels(2)
    step = {key: two[key] - one[key] for key in two}
    names = sorted({name for name, _ in step}, key=lambda name: -step.get((name, "us"), 0))
    return {"prefill": sum(v for (_, what), v in one.items() if what == "n"),
            "decode_step": sum(v for (_, what), v in step.items() if what == "n"),
            "by_kernel": [{"name": name, "count": step[(name, "n")], "us": round(step[(name, "us")], 1)}
                          for name in names[:top]]}


def generate_summary(data: dict) -> str:
    """One line for the proof's summary table (a section cut off at its limit lists the arms it finished)."""
    arms = ("graphs", "graphs_compiled", "graphs_no_cudnn", "static", "static_no_cudnn", "eager", "transformers",
            "transformers_no_cudnn")
    parts = []
    for b, row in data.get("batches", {}).items():
        cells = []
        for a in (a for a in arms if a in row):
            cells.append(f"{a} {row[a]['tokens_per_s']:,.0f}")
            if f"{a}_over_bound" in row:  # the graph arms
                bound = row[f"{a}_over_bound"]
                cells[-1] += (f" tokens/s ({row[a]['step_ms']:.2f} ms/step, "
                              f"{'-' if bound is None else format(bound, '.0%')} of bandwidth bound)")
        if "capture" in row:
            cells.append(f"capture {row['capture']['capture_s']:.3f} s")
        if "graphs_compiled" in row:
            cells.append(f"compile warm-up {row['graphs_compiled']['warmup_s']:.1f} s")
        if "kernels_per_step" in row:
            cells.append(f"kernels_per_step { {arm: k['decode_step'] for arm, k in row['kernels_per_step'].items()} }")
        for key in ("sdpa", "identical", "compiled_step_bits"):
            if key in row:
                cells.append(f"{key} {row[key]}")
        parts.append(f"b{b}: " + ", ".join(cells))
    return "; ".join(parts) or "no batches"


# ------------------------------------------------------------------------------------- decode_bits (its own section)

# The compiled decode step's elementwise pieces, each compiled alone with each option set and compared with eager
# bit for bit at the model's shapes: which piece (if any) leaves eager's bits on this device, and which inductor
# options bring it back. `inductor_defaults` is what torch.compile does unasked; `mindvl` is
# decode_compile.INDUCTOR_OPTIONS; `mindvl_without_eager_numerics` leaves out its triton-only pair (division rounded
# as eager's, subnormals kept).
EAGER_NUMERICS = ("eager_numerics.division_rounding", "eager_numerics.disable_ftz")


def option_sets() -> dict[str, dict]:
    from mindvl.infer import decode_compile

    mindvl = decode_compile.INDUCTOR_OPTIONS
    return {"inductor_defaults": {},
            "mindvl_without_eager_numerics": {k: v for k, v in mindvl.items() if k not in EAGER_NUMERICS},
            "mindvl": dict(mindvl)}


def decode_pieces(model, rows: int, device) -> dict:
    """name -> (fn, args, the eager reference's fn): the first decoder layer's input norm, the deferred residual add
    into it (text.residual_norm), the SwiGLU product (the MLP's own activation), the same product with SiLU written
    as eager's CUDA kernel computes it (x / (1 + exp(-x)) in fp32: triton's sigmoid is another formula), the
    rotation of the queries (layers.apply_rotary with the model's bf16 tables), and (an RMSNorm) the norm with its
    mean of squares computed by eager's kernels (a triton reduction may sum in another order)."""
    import torch

    from mindvl.models.layers import RMSNorm, apply_rotary
    from mindvl.models.text import residual_norm

    lm = model.language_model
    layer, cfg = lm.layers[0], lm.cfg
    dtype = lm.embed_tokens.weight.dtype
    gen = torch.Generator(device=device).manual_seed(rows)

    def randn(*shape, scale: float = 1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    h, r = randn(rows, cfg.hidden_size), randn(rows, cfg.hidden_size, scale=0.5)
    gate, up = randn(rows, cfg.intermediate_size, scale=2.0), randn(rows, cfg.intermediate_size)
    q = randn(rows, cfg.num_attention_heads, cfg.head_dim)
    positions = torch.arange(100, 100 + rows, device=device)
    cos, sin = lm.rotary_tables(positions.expand(3, rows) if cfg.mrope_section else positions, dtype)
    act = layer.mlp.act

    def swiglu(g, u):
        return act(g) * u

    def swiglu_by_formula(g, u):
        x = g.float()
        return (x / (1 + torch.exp(-x))).to(g.dtype) * u

    norm = layer.input_layernorm
    pieces = {"rms_norm": (norm, (h,), None),
              "residual_add_rms_norm": (residual_norm, (norm, h, r), None),
              "swiglu_product": (swiglu, (gate, up), None),
              "swiglu_product_by_formula": (swiglu_by_formula, (gate, up), swiglu),
              "rotary": (apply_rotary, (q, cos, sin), None)}
    if type(norm) is RMSNorm:  # its formula, with the mean of squares left to eager's reduction kernel
        def rms_norm_mean_in_eager(x):
            xf = x.float()
            xf = xf * torch.rsqrt(_mean_of_squares(xf) + norm.eps)
            return norm.weight * xf.to(x.dtype)

        pieces["rms_norm_mean_in_eager"] = (rms_norm_mean_in_eager, (h,), norm)
    return pieces


def _mean_of_squares(xf):
    """x [..., d] fp32 -> mean(x^2) [..., 1], run by eager's kernels inside a compiled piece (a graph break): if the
    compiled norm leaves eager's bits and this does not, the reduction's order is what differs."""
    import torch

    @torch.compiler.disable
    def eager(x):
        return x.pow(2).mean(-1, keepdim=True)

    return eager(xf)


def piece_bits(model, rows_list=(1, 32), backend: str = "inductor", out: dict | None = None,
               progress=None) -> dict:
    """{rows: {piece: {option set: {equal, fraction_differing, max_abs_diff} or {error}}}}, filled into `out`: each
    piece compiled alone (a fresh dynamo state per compilation) against its eager reference; at the first rows
    count with every option set, at the others with `mindvl` only (a compilation is a second or two of triton
    each). A compilation that fails is recorded and the next one runs; `progress()` is called after each piece (the
    section saves what it has)."""
    import torch

    from mindvl.infer import decode_compile

    device = model.language_model.embed_tokens.weight.device
    sets = option_sets()
    out = {} if out is None else out
    for i, rows in enumerate(rows_list):
        row = out[str(rows)] = {}
        for name, (fn, args, reference) in decode_pieces(model, rows, device).items():
            with torch.inference_mode():
                want = (reference or fn)(*args)
                row[name] = {}
                for set_name, options in sets.items():
                    if i and set_name != "mindvl":
                        continue
                    torch._dynamo.reset()
                    opts = decode_compile.inductor_options(options) if backend == "inductor" else None
                    try:
                        got = torch.compile(fn, backend=backend, options=opts, dynamic=False)(*args)
                    except Exception as exc:  # noqa: BLE001 - recorded: the other pieces and options still count
                        row[name][set_name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                        continue
                    diff = (got.float() - want.float()).abs()
                    row[name][set_name] = {"equal": torch.equal(got, want),
                                           "fraction_differing": round((diff > 0).float().mean().item(), 6),
                                           "max_abs_diff": diff.max().item()}
            if progress is not None:
                progress()
    torch._dynamo.reset()
    return out


def sec_decode_bits(args, work: Path, save_partial=None) -> dict:
    """The decode_bits section: piece_bits on the prepared model in bf16 (the dry run: the CPU, fp32 and aot_eager,
    the code's path only). Its own section, after generate, so that its compilations cannot cost generate's arms
    their time."""
    import torch

    from mindvl.checkpoint import load_model
    from mindvl.infer import decode_compile

    if not (work / "mindvl").is_dir():
        raise RuntimeError("the decode_bits section needs the prepare section's model (run prepare first)")
    dry = args.dry_run
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not dry else torch.device("cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = load_model(work / "mindvl", dtype=dtype, device=device).eval()
    resolved = {name: decode_compile.inductor_options(o) for name, o in option_sets().items()}
    out = {"dtype": str(dtype), "options": resolved, "pieces": {}}

    def progress() -> None:  # cut off at the section's limit, the pieces done so far are kept
        if save_partial is not None:
            save_partial(args, out, "pieces")

    progress()
    piece_bits(model, (1, 4) if dry else (1, 32), "aot_eager" if device.type == "cpu" else "inductor",
               out["pieces"], progress)
    return out


def decode_bits_summary(data: dict) -> str:
    """One line: per rows count, the pieces whose compiled bits differ from eager's, by option set."""
    parts = []
    for rows, pieces in data.get("pieces", {}).items():
        differ = {f"{piece}/{name}": r.get("fraction_differing", r.get("error")) for piece, sets in pieces.items()
                  for name, r in sets.items() if not r.get("equal")}
        parts.append(f"rows {rows}: " + (f"differ {differ}" if differ else "every piece equal to eager"))
    return "; ".join(parts) or "no pieces"
