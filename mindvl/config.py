"""Training recipes: typed dataclasses, YAML loading and `key=value` overrides, validated with errors naming the key.

    cfg = load_recipe("recipes/tiny/warmup.yaml", ["output_dir=runs/a", "max_steps=20", "optim.lr=5e-4"])
    cfg = load_recipe("tiny/warmup")          # the same recipe, shipped in the package, from any directory

A recipe has the sections below; `data:` is mindvl.data.DataConfig, built by the same converter (mindvl.typed) once
at load, its `seed` defaulting to the recipe's `seed`. Overrides take dotted paths (`optim.lr=1e-3`) or the short
aliases in ALIASES; values are parsed as YAML (`1e-3`, `true`, `[a, b]`, `null`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from mindvl.conventions import MODULES
from mindvl.data.config import DataConfig
from mindvl.typed import build as typed_build
from mindvl.typed import check_keys

# Everyday overrides have short names; everything else is reachable by its dotted path.
ALIASES = {
    "output_dir": "output_dir",
    "max_steps": "budget.max_steps",
    "max_tokens": "budget.max_tokens",
    "checkpoint_every": "checkpoint.every",
    "resume": "checkpoint.resume",
    "lr": "optim.lr",
    "seed": "seed",
    "init_from": "model.init_from",
    "overwrite": "overwrite",
}

PHASES = ("warmup", "pretrain", "multitask", "sft")
# What each paper phase trains (Table 1): the warm-up aligns the towers through the MLP adaptor alone. `pretrain` is
# the extra phase of the paper's 4-phase ablation (Table 17: ViT + MLP adaptor, the LLM frozen).
PHASE_TRAINABLE = {"warmup": ["projector"], "pretrain": ["visual", "projector"], "multitask": list(MODULES),
                   "sft": list(MODULES)}


@dataclass
class ModelSection:
    """Where the weights come from: `init_from` (a mindvl folder, e.g. the previous phase's `final`), `compose`
    (HF Qwen2.5-VL vision + LLM folders, composed into `OUTPUT_DIR/composed` once) or `arch` (a config for
    seeded random weights; vocab size and vision token ids come from the tokenizer)."""

    init_from: str | None = None
    compose: dict[str, str] | None = None  # {vision: DIR, language: DIR}
    arch: dict[str, Any] | None = None  # {text: {...TextConfig}, vision: {...VisionConfig}}
    init_seed: int | None = None  # None: the recipe's `seed`
    attention_backend: str = "auto"
    # shape preset for `mindvl plan` when the folders above do not exist yet (mindvl.plan.presets; training ignores it)
    preset: str | None = None
    # LoRA adapters {r, alpha, dropout, targets, modules, quantize} (mindvl.models.lora.LoRAConfig; built and
    # checked by mindvl.train.lora, since config may not import models); null: full weights as the phase says
    lora: dict[str, Any] | None = None


@dataclass
class PhaseSection:
    name: str = "multitask"  # warmup | pretrain | multitask | sft
    trainable: list[str] | None = None  # default: PHASE_TRAINABLE[name]


@dataclass
class BatchSection:
    global_batch_size: int = 1  # packs (one packed row of data.seq_len slots each) per optimizer step, all ranks
    micro_batch_size: int = 1  # packs per forward; the packed layout concatenates samples, so this is 1
    gradient_accumulation: int | None = None  # derived: global_batch_size / data_shards; checked when given
    data_shards: int | None = None  # data-parallel shards of the stream (default: world size); see trainer


@dataclass
class OptimSection:
    lr: float = 1e-5  # maximum LR
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    # Per-module multiplier of the LR schedule ({language_model: 0.1}): a pretrained LLM fine-tunes at a fraction of
    # the rate a tower trained from scratch needs (the tiny testbed's recipes). Keys: the modules of phase.trainable.
    lr_scale: dict[str, float] = field(default_factory=dict)
    # MoE language models: DeepSeek-V3's auxiliary-loss-free balancing moves each router's correction bias by this
    # much per optimizer step against its experts' load (0 disables; only while the language model trains).
    router_bias_rate: float = 1e-3
    # A step whose loss or gradient norm is not finite is skipped on every rank; this many in a row stop the run.
    max_bad_steps: int = 5
    # Loss-spike guard (off: null): a step whose loss exceeds this factor times the median loss of the last
    # `loss_spike_window` good steps counts as a bad step too (skipped, counted, part of a streak).
    loss_spike_factor: float | None = None
    loss_spike_window: int = 32


@dataclass
class ScheduleSection:
    warmup_ratio: float = 0.1
    decay: str = "cosine"  # cosine | linear | constant
    # A resume normally refuses a changed budget (max_steps / max_tokens): it would silently bend the LR schedule.
    allow_change: bool = False


@dataclass
class BudgetSection:
    max_steps: int | None = None
    max_tokens: int | None = None  # global packed tokens; converted to steps via global_batch_size * seq_len


@dataclass
class CheckpointSection:
    every: int | None = None  # optimizer steps between checkpoints (always one at the end)
    keep: int = 2
    resume: str | None = None  # null | auto | a checkpoint folder
    every_minutes: float | None = None  # also checkpoint when this much wall time passed since the last one
    async_save: bool = False  # write DCP shards in the background (torch.distributed.checkpoint.async_save)


@dataclass
class LoggingSection:
    every: int = 1
    tensorboard: bool = True
    progress: bool = True
    plot: bool = True
    wandb: bool = False  # Weights & Biases run (extra `wandb`); project/name from WANDB_* environment variables
    mlflow: bool = False  # MLflow run (extra `mlflow`); tracking URI from MLFLOW_TRACKING_URI


@dataclass
class EvalSection:
    """Evaluation during training, logged with the step's metrics (`eval/...` keys) every `every` steps and at the
    end: validation loss on the held-out data (`data.eval_sources` or `data.eval_fraction`) over `batches` packs
    per rank, and optionally a benchmark (mindvl eval's runner) on its first `limit` items."""

    every: int | None = None  # null: no evaluation during training
    batches: int = 4
    benchmark: str | None = None  # a benchmark name of `mindvl eval` (e.g. synth_ocr)
    benchmark_path: str | None = None  # its local files
    limit: int = 16
    max_new_tokens: int = 32


@dataclass
class ParallelSection:
    fsdp: str | bool = "auto"  # auto (when world size > 1) | on | off (YAML reads on/off as booleans)
    mixed_precision: str = "auto"  # auto (bf16 on accelerators, fp32 on CPU) | bf16 | fp32
    # off | full (every block of both towers recomputed in backward) | selective (matmul outputs kept, the cheap
    # element-wise ops recomputed); YAML true/false read as full/off
    activation_checkpointing: str | bool = False
    # how FSDP accumulates gradients over micro-batches: sharded (reduce-scatter every micro-batch into sharded
    # fp32 gradients) | unsharded (sync only after the last one; full-size fp32 gradients on every rank)
    grad_accumulation: str = "sharded"
    # torch.compile of every block of both towers (regional, as torchtitan): auto (on CUDA where triton is installed,
    # off elsewhere) | on | off (YAML true/false read as on/off)
    compile: str | bool = "auto"
    device: str = "auto"  # auto | cpu | cuda | npu
    # ranks sharing one copy of each MoE layer's experts (E / N experts per rank, tokens sent by all-to-all); must
    # divide the routed experts and the world size; 1 = none (FSDP shards experts like every other weight)
    expert_parallel: int = 1
    # ranks splitting each packed row of the language model (all-to-all over attention heads,
    # mindvl.train.context_parallel); they read the same data; must divide the world size and the attention heads
    context_parallel: int = 1
    # ranks splitting each dense LLM layer (attention heads, MLP width, vocabulary) with sequence parallelism
    # between them (mindvl.train.tensor_parallel); must divide the heads, KV heads, MLP width and world size
    tensor_parallel: int = 1


@dataclass
class Recipe:
    output_dir: str = "runs/default"
    seed: int = 0  # model init (unless model.init_seed) and data order (unless data.seed)
    overwrite: bool = False  # a fresh run may replace a finished or partial run in output_dir
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    phase: PhaseSection = field(default_factory=PhaseSection)
    batch: BatchSection = field(default_factory=BatchSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    budget: BudgetSection = field(default_factory=BudgetSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    # the `data:` mapping as loaded (to_dict writes it back unchanged); None for a recipe built in code
    _data_raw: ClassVar[dict[str, Any] | None] = None

    def _check_tensor_parallel(self) -> None:
        """`parallel.tensor_parallel` against the architecture in the recipe (a model given by folder is checked
        when built: mindvl.train.tensor_parallel.check_tensor_parallel)."""
        tp = self.parallel.tensor_parallel
        _check(isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1, "parallel.tensor_parallel",
               f"must be an integer >= 1, got {tp!r}")
        text = (self.model.arch or {}).get("text", {}) if tp > 1 else {}
        _check(text.get("family") != "deepseek_v3", "parallel.tensor_parallel",
               f"{tp}: tensor parallelism splits dense GQA language models (qwen2/qwen3); a deepseek_v3 model "
               "splits its experts with parallel.expert_parallel; set it to 1")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = text.get(name)
            _check(value is None or value % tp == 0, "parallel.tensor_parallel",
                   f"{tp} must divide model.arch.text.{name} ({value})")

    def validate(self) -> None:
        """Cross-field checks; each error names the key to fix."""
        _check(self.phase.name in PHASES, "phase.name", f"must be one of {PHASES}, got {self.phase.name!r}")
        for m in self.trainable_modules:
            _check(m in MODULES, "phase.trainable", f"unknown module {m!r} (known: {MODULES})")
        b = self.batch
        _check(b.global_batch_size >= 1, "batch.global_batch_size", "must be >= 1")
        _check(b.micro_batch_size == 1, "batch.micro_batch_size",
               "must be 1: a micro-batch is one packed row (raise data.seq_len to put more samples in it)")
        _check(b.data_shards is None or b.data_shards >= 1, "batch.data_shards", "must be >= 1")
        _check(self.optim.lr > 0, "optim.lr", "must be > 0")
        _check(0 <= self.optim.min_lr <= self.optim.lr, "optim.min_lr", "must lie in [0, optim.lr]")
        _check(len(self.optim.betas) == 2, "optim.betas", "must be two numbers")
        _check(self.optim.grad_clip is None or self.optim.grad_clip > 0, "optim.grad_clip", "must be > 0 or null")
        for m, scale in self.optim.lr_scale.items():
            _check(m in MODULES, "optim.lr_scale", f"unknown module {m!r} (known: {MODULES})")
            _check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
                   f"optim.lr_scale.{m}", f"must be a number > 0, got {scale!r}")
        ep = self.parallel.expert_parallel
        _check(isinstance(ep, int) and ep >= 1, "parallel.expert_parallel", f"must be an integer >= 1, got {ep!r}")
        text = (self.model.arch or {}).get("text", {}) if ep > 1 else {}
        if text:
            _check(text.get("family", "qwen3") == "deepseek_v3", "parallel.expert_parallel",
                   f"{ep} asks for expert parallelism, but model.arch.text is a dense {text.get('family', 'qwen3')} "
                   "model; set it to 1")
            experts = text.get("n_routed_experts")
            _check(experts is None or experts % ep == 0, "parallel.expert_parallel",
                   f"{ep} must divide model.arch.text.n_routed_experts ({experts})")
        cp = self.parallel.context_parallel
        _check(isinstance(cp, int) and cp >= 1, "parallel.context_parallel", f"must be an integer >= 1, got {cp!r}")
        heads = (self.model.arch or {}).get("text", {}).get("num_attention_heads") if cp > 1 else None
        _check(heads is None or heads % cp == 0, "parallel.context_parallel",
               f"{cp} must divide model.arch.text.num_attention_heads ({heads})")
        _check(cp == 1 or ep == 1, "parallel.context_parallel",
               f"{cp} with parallel.expert_parallel {ep} is not supported yet; set one of them to 1")
        _check(cp == 1 or self.parallel.fsdp not in ("off", False), "parallel.context_parallel",
               f"{cp} needs FSDP (it sums the context ranks' gradients); set parallel.fsdp to auto or on")
        self._check_tensor_parallel()
        tp = self.parallel.tensor_parallel
        _check(cp == 1 or tp == 1, "parallel.context_parallel",
               f"{cp} with parallel.tensor_parallel {tp} is not supported yet; set one of them to 1")
        _check(tp == 1 or not self.model.lora, "parallel.tensor_parallel",
               f"{tp} with model.lora is not supported yet (the adapted layers are not split); set it to 1")
        _check(self.optim.router_bias_rate >= 0, "optim.router_bias_rate", "must be >= 0")
        _check(0 <= self.schedule.warmup_ratio < 1, "schedule.warmup_ratio", "must lie in [0, 1)")
        _check(self.schedule.decay in ("cosine", "linear", "constant"), "schedule.decay",
               f"must be cosine, linear or constant, got {self.schedule.decay!r}")
        _check((self.budget.max_steps is None) != (self.budget.max_tokens is None), "budget",
               "give exactly one of budget.max_steps or budget.max_tokens")
        for key in ("max_steps", "max_tokens"):
            v = getattr(self.budget, key)
            _check(v is None or v >= 1, f"budget.{key}", "must be >= 1")
        _check(self.checkpoint.every is None or self.checkpoint.every >= 1, "checkpoint.every", "must be >= 1")
        _check(self.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
        _check(self.checkpoint.every_minutes is None or self.checkpoint.every_minutes > 0,
               "checkpoint.every_minutes", "must be > 0 or null")
        _check(self.optim.max_bad_steps >= 1, "optim.max_bad_steps", "must be >= 1")
        _check(self.optim.loss_spike_factor is None or self.optim.loss_spike_factor > 1, "optim.loss_spike_factor",
               "must be > 1 (a loss above factor x the running median is a bad step), or null to turn it off")
        _check(self.optim.loss_spike_window >= 1, "optim.loss_spike_window", "must be >= 1")
        _check(self.logging.every >= 1, "logging.every", "must be >= 1")
        for key, module, extra in (("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")):
            # checked here, on every rank, so a missing extra never stops rank 0 alone
            _check(not getattr(self.logging, key) or _installed(module), f"logging.{key}",
                   f"true needs the `{module}` package: pip install 'mindvl[{extra}]'")
        _check(self.eval.every is None or self.eval.every >= 1, "eval.every", "must be >= 1 or null")
        _check(self.eval.batches >= 1, "eval.batches", "must be >= 1")
        _check(self.eval.limit >= 1, "eval.limit", "must be >= 1")
        _check((self.eval.benchmark is None) == (self.eval.benchmark_path is None), "eval.benchmark",
               "give both eval.benchmark and eval.benchmark_path, or neither")
        if isinstance(self.parallel.fsdp, bool):
            self.parallel.fsdp = "on" if self.parallel.fsdp else "off"
        _check(self.parallel.fsdp in ("auto", "on", "off"), "parallel.fsdp", "must be auto, on or off")
        if isinstance(self.parallel.compile, bool):
            self.parallel.compile = "on" if self.parallel.compile else "off"
        _check(self.parallel.compile in ("auto", "on", "off"), "parallel.compile", "must be auto, on or off")
        _check(self.parallel.mixed_precision in ("auto", "bf16", "fp32"), "parallel.mixed_precision",
               "must be auto, bf16 or fp32")
        ac = self.parallel.activation_checkpointing
        if isinstance(ac, bool):
            self.parallel.activation_checkpointing = "full" if ac else "off"
        _check(self.parallel.activation_checkpointing in ("off", "full", "selective"),
               "parallel.activation_checkpointing", "must be off, full or selective (or true/false)")
        _check(self.parallel.grad_accumulation in ("sharded", "unsharded"), "parallel.grad_accumulation",
               "must be sharded or unsharded")
        _check(self.parallel.device in ("auto", "cpu", "cuda", "npu"), "parallel.device",
               "must be auto, cpu, cuda or npu")
        m = self.model
        given = [k for k in ("init_from", "compose", "arch") if getattr(m, k)]
        _check(len(given) == 1, "model", f"give one of init_from, compose, arch (got {given})")
        if m.compose is not None:
            check_keys(m.compose, ("language", "vision"), "model.compose")
            _check(set(m.compose) == {"vision", "language"}, "model.compose", "needs both `vision` and `language`")
        if m.arch is not None:
            check_keys(m.arch, ("text", "vision"), "model.arch")
        _check(self.eval.every is None or self.data.eval_config() is not None or self.eval.benchmark is not None,
               "eval.every", "needs held-out data (data.eval_sources or data.eval_fraction) or eval.benchmark")

    @property
    def data_keys_given(self) -> set[str]:
        """The keys the recipe's `data:` section sets (all of them for a recipe built in code), e.g. to tell an
        image resolution left at its default from one chosen."""
        if self._data_raw is None:
            return {f.name for f in dataclasses.fields(DataConfig)}
        return set(self._data_raw)

    @property
    def trainable_modules(self) -> list[str]:
        return list(self.phase.trainable) if self.phase.trainable is not None else PHASE_TRAINABLE[self.phase.name]

    def to_dict(self) -> dict[str, Any]:
        """The recipe as written to a run's recipe.json: `data` is the section as given (defaults left out, the
        seed inherited from `seed`), so a recipe.json written before `data` was typed reads back the same."""
        out = dataclasses.asdict(dataclasses.replace(self, data=DataConfig()))
        out["data"] = dataclasses.asdict(self.data) if self._data_raw is None else copy.deepcopy(self._data_raw)
        return out


def _installed(module: str) -> bool:
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")


# ------------------------------------------------------------------------------------------------ typed building

# The one mapping -> dataclass converter (mindvl.typed), re-exported under its historical name.
build = typed_build


# ------------------------------------------------------------------------------------------------- overrides


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column, 1-based)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{where}{context + ', ' if context else ''}{problem}"


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`key=value` (dotted path or alias) into the raw recipe dict; the value is parsed as YAML."""
    if "=" not in item:
        raise ValueError(f"override {item!r}: expected key=value")
    key, text = item.split("=", 1)
    key = ALIASES.get(key.strip(), key.strip())
    top = [f.name for f in dataclasses.fields(Recipe)]
    if "." not in key and key not in top:  # a typo of a short name (max_step=20) would only list the sections
        import difflib

        close = difflib.get_close_matches(key, [*ALIASES, *top], n=1)
        raise ValueError(f"{key}: unknown key{f'; did you mean {close[0]}?' if close else ''} (short names: "
                         f"{', '.join(ALIASES)}; sections: {', '.join(t for t in top if t not in ALIASES)})")
    try:  # safe_load: a tag such as !!python/object is refused, never constructed
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"override {item!r}: not a plain YAML value ({yaml_problem(exc)}); values are numbers, "
                         "strings, lists or mappings: quote the value to pass it as text") from None
    if isinstance(value, str):
        try:  # YAML 1.1 reads `2e-3` (no dot) as a string; on the command line it means the number
            value = float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            pass
    if key == "budget.max_steps" and value is not None:
        raw.setdefault("budget", {})["max_tokens"] = None  # a step budget replaces a token budget, and vice versa
    if key == "budget.max_tokens" and value is not None:
        raw.setdefault("budget", {})["max_steps"] = None
    if key == "model.init_from" and value is not None:  # starting from a folder replaces the random/HF init
        raw.setdefault("model", {}).update(arch=None, compose=None)
    parts = key.split(".")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"override {'.'.join(parts[: i + 1])}: is not a section")
        node = nxt
    node[parts[-1]] = value


PACKAGED_RECIPES = Path(__file__).resolve().parent / "recipes"


def packaged_recipes() -> list[str]:
    """Names of the recipes shipped inside the package (`tiny/warmup`, ...), for `mindvl train NAME`."""
    return sorted(p.relative_to(PACKAGED_RECIPES).with_suffix("").as_posix() for p in PACKAGED_RECIPES.rglob("*.yaml"))


def find_recipe(name: str | Path) -> Path:
    """A recipe file: the path itself when it exists, else a packaged recipe by name (`tiny/warmup`, also written
    `tiny/warmup.yaml` or `recipes/tiny/warmup.yaml`, as a checkout's README writes it)."""
    p = Path(name)
    if p.is_file():
        return p
    key = p.as_posix().removesuffix(".yaml")
    key = key.split("recipes/", 1)[1] if "recipes/" in key and not p.is_absolute() else key
    packaged = PACKAGED_RECIPES / f"{key}.yaml"
    if packaged.is_file():
        return packaged
    raise FileNotFoundError(f"recipe {name} does not exist (no such file, and no packaged recipe {key!r}; packaged: "
                            f"{', '.join(packaged_recipes())}; see mindvl train --list)")


def _resolve_inputs(raw: dict[str, Any], base: Path) -> None:
    """Relative paths of the keys that name input files or folders -> paths under the recipe file's folder `base`.
    output_dir and data.synth_cache are outputs and stay relative to the working directory."""

    def resolve(value: Any) -> Any:
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute():
            return value
        return os.path.normpath(base / value)

    model = raw.get("model")
    if isinstance(model, dict):
        if "init_from" in model:
            model["init_from"] = resolve(model["init_from"])
        if isinstance(model.get("compose"), dict):
            model["compose"] = {k: resolve(v) for k, v in model["compose"].items()}
    data = raw.get("data")
    if isinstance(data, dict):
        if "tokenizer" in data:
            data["tokenizer"] = resolve(data["tokenizer"])
        for source in data.get("sources") or []:
            if isinstance(source, dict):
                for key in ("path", "paths"):
                    if isinstance(source.get(key), list):
                        source[key] = [resolve(v) for v in source[key]]
                    elif key in source:
                        source[key] = resolve(source[key])
        if isinstance(data.get("sources"), list):  # a bare string source is a path too
            data["sources"] = [resolve(s) if isinstance(s, str) else s for s in data["sources"]]


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None,
                raw: dict[str, Any] | None = None) -> Recipe:
    """Read a YAML recipe (a file, or a packaged recipe by name: `tiny/warmup`) or a raw dict, apply overrides,
    build and validate it. Relative input paths written in the file (model.init_from, model.compose, data.tokenizer,
    data source paths) resolve against the file's folder; overrides, output_dir and data.synth_cache against the
    working directory."""
    if raw is None:
        p = find_recipe(path)  # type: ignore[arg-type]
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"recipe {p}: invalid YAML ({yaml_problem(exc)})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"recipe {p}: top level must be a mapping")
        _resolve_inputs(raw, p.resolve().parent)
    else:
        raw = yaml.safe_load(yaml.safe_dump(raw))  # deep copy through the same value space as a file
    for item in overrides or []:
        apply_override(raw, item)
    data_raw = raw.get("data")
    recipe = build(Recipe, raw)
    if not (isinstance(data_raw, dict) and "seed" in data_raw):  # data order follows `seed` unless pinned
        recipe.data.seed = recipe.seed
    recipe._data_raw = copy.deepcopy(data_raw)
    recipe.validate()
    return recipe
