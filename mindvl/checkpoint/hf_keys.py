"""One tensor-name table per family, read in both directions: transformers/hub names <-> mindvl names.

Import (`mindvl_name`, `import_name`) and export (`hf_tensors`) are both derived from `KEY_TABLES`, so a rule added
for a new family (or a renamed module) is written once and the two directions cannot drift apart.

A rule pairs an HF pattern with a mindvl pattern. Placeholders: `{rest}` is any dotted tail, `{layer}` and `{expert}`
are integers, `{proj}` is gate, up or down. A placeholder present on the HF side only (`{expert}`) means mindvl stacks
those HF tensors along a new dim 0 (DeepSeek-V3's per-expert weights -> `experts.{proj}_proj [E, ...]`); export
unbinds them again. Rules are tried in order, first match wins (specific names before the `{rest}` catch-alls).

Import also accepts spellings that export never writes: transformers >= 4.52's in-memory prefixes
(`model.visual.`, `model.language_model.`) are read as the hub's (`visual.`, `model.`), and unknown names pass
through unchanged (the loader reports them as unexpected). Tensor contents are not the table's business, except the
expert stacking it names: the patch embedding's Conv3d <-> matmul reshape and the fused `gate_up_proj` split
(transformers 5's in-memory experts, import only) live with the importer and exporter.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_PLACEHOLDERS = {"rest": r".+", "layer": r"\d+", "expert": r"\d+", "proj": r"gate|up|down"}


@dataclass(frozen=True)
class KeyRule:
    hf: str  # e.g. "model.{rest}"
    ours: str  # e.g. "language_model.{rest}"


_VISION = (  # Qwen2.5-VL's vision tower and merger (mindvl's projector)
    KeyRule("visual.patch_embed.proj.weight", "visual.patch_embed.weight"),
    KeyRule("visual.merger.ln_q.{rest}", "projector.norm.{rest}"),
    KeyRule("visual.merger.mlp.0.{rest}", "projector.fc1.{rest}"),
    KeyRule("visual.merger.mlp.2.{rest}", "projector.fc2.{rest}"),
    KeyRule("visual.{rest}", "visual.{rest}"),
)
_EXPERTS = (  # the hub's per-expert SwiGLU weights <-> one [E, ...] tensor per projection
    KeyRule("model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight",
            "language_model.layers.{layer}.mlp.experts.{proj}_proj"),
)
_LLM = (
    KeyRule("lm_head.weight", "language_model.lm_head.weight"),
    KeyRule("model.{rest}", "language_model.{rest}"),
)
# Qwen3-VL: hub and transformers (>= 4.57) both use the nested names, so export writes them and no alias applies.
_QWEN3_VL = (
    KeyRule("model.visual.patch_embed.proj.{rest}", "visual.patch_embed.{rest}"),
    KeyRule("model.visual.merger.norm.{rest}", "projector.norm.{rest}"),
    KeyRule("model.visual.merger.linear_fc1.{rest}", "projector.fc1.{rest}"),
    KeyRule("model.visual.merger.linear_fc2.{rest}", "projector.fc2.{rest}"),
    KeyRule("model.visual.deepstack_merger_list.{layer}.norm.{rest}", "projector.deepstack.{layer}.norm.{rest}"),
    KeyRule("model.visual.deepstack_merger_list.{layer}.linear_fc1.{rest}", "projector.deepstack.{layer}.fc1.{rest}"),
    KeyRule("model.visual.deepstack_merger_list.{layer}.linear_fc2.{rest}", "projector.deepstack.{layer}.fc2.{rest}"),
    KeyRule("model.visual.{rest}", "visual.{rest}"),
    KeyRule("lm_head.weight", "language_model.lm_head.weight"),
    KeyRule("model.language_model.{rest}", "language_model.{rest}"),
)
KEY_TABLES: dict[str, tuple[KeyRule, ...]] = {
    "qwen2_5_vl": _VISION + _LLM,
    # The MoE's fused experts keep their names (`experts.gate_up_proj` -> split into gate/up, layouts) in
    # hf.TensorPlan (import) and hf_export (export): a content operation, not a rename.
    "qwen3_vl": _QWEN3_VL,
    "qwen3_vl_moe": _QWEN3_VL,
    "qwen3_5": _QWEN3_VL,  # Qwen3.5: the same nested names (no DeepStack mergers; linear_attn.* pass through)
    "qwen3_5_moe": (  # + the hub's per-expert weights, stacked as for DeepSeek-V3
        KeyRule("model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight",
                "language_model.layers.{layer}.mlp.experts.{proj}_proj"),
        *_QWEN3_VL,
    ),
    "qwen3": _LLM,
    "qwen2": _LLM,
    "deepseek_v3": _EXPERTS + _LLM,
    "mindvl": (),  # already ours: every name passes through on import
}
# Import-only spellings of HF prefixes (transformers >= 4.52 in memory -> hub), applied before the table.
_HF_ALIASES = (("model.visual.", "visual."), ("model.language_model.", "model."))
KEY_TABLES["qwen3_5_text"] = _LLM  # Qwen3.5's language model alone (Qwen3_5ForCausalLM)
KEY_TABLES["qwen3_5_moe_text"] = _EXPERTS + _LLM
_NO_ALIASES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # tables written in the nested names themselves
# Non-parameters some exports carry (mindvl recomputes them), and Qwen3.5's multi-token-prediction head (`mtp.*`),
# which transformers drops on load too.
_SKIPPED = re.compile(r"rotary_emb\.inv_freq$|^mtp\.")


def _compile(pattern: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>{_PLACEHOLDERS[m.group(1)]})")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("^" + "".join(out) + "$")


@dataclass(frozen=True)
class ImportName:
    name: str  # the mindvl tensor this HF tensor becomes (or a slice of, when `expert` is set)
    expert: int | None = None  # index along the stacked dim 0


class KeyMap:
    """One family's table compiled for both directions."""

    def __init__(self, family: str) -> None:
        if family not in KEY_TABLES:
            raise ValueError(f"no tensor-name table for family {family!r} (known: {sorted(KEY_TABLES)})")
        self.family = family
        self._rules = [(_compile(r.hf), _compile(r.ours), r) for r in KEY_TABLES[family]]

    def to_ours(self, hf_name: str) -> ImportName | None:
        """An HF tensor name -> its mindvl name, or None for a non-parameter mindvl recomputes (rotary buffers)."""
        if _SKIPPED.search(hf_name):
            return None
        for alias, hub in _HF_ALIASES if self.family not in _NO_ALIASES else ():
            if hf_name.startswith(alias):
                hf_name = hub + hf_name[len(alias):]
                break
        for hf_re, _, rule in self._rules:
            m = hf_re.match(hf_name)
            if m:
                fields = m.groupdict()
                expert = fields.pop("expert", None)
                return ImportName(rule.ours.format(**fields), None if expert is None else int(expert))
        return ImportName(hf_name)  # unknown names pass through; the loader reports them as unexpected

    def to_hf(self, name: str) -> tuple[str, bool]:
        """A mindvl tensor name -> (HF name, stacked). When stacked, the HF name has an `{expert}` field to format
        per slice of dim 0."""
        for _, ours_re, rule in self._rules:
            m = ours_re.match(name)
            if m:
                stacked = "{expert}" in rule.hf
                fields = {**m.groupdict(), **({"expert": "{expert}"} if stacked else {})}
                return rule.hf.format(**fields), stacked
        raise ValueError(f"no transformers name for tensor {name!r} in a {self.family} model")

    def hf_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs for one mindvl tensor: a stacked [E, ...] tensor becomes E HF tensors."""
        hf, stacked = self.to_hf(name)
        if not stacked:
            yield hf, tensor
            return
        for e, piece in enumerate(tensor.unbind(0)):
            yield hf.format(expert=e), piece


@functools.cache
def key_map(family: str) -> KeyMap:
    """The compiled table of `family` (qwen2_5_vl, qwen3, qwen2, deepseek_v3, or mindvl: names already ours)."""
    return KeyMap(family)


def mindvl_name(hf_name: str, family: str) -> str | None:
    """One HF tensor name -> the mindvl tensor it becomes (a stacked tensor for a per-expert weight), or None."""
    got = key_map(family).to_ours(hf_name)
    return None if got is None else got.name
