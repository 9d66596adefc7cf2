"""The one mapping -> dataclass converter: recipes, the data section, model configs and curate pipelines.

    cfg = build(DataConfig, {"sources": ["a.jsonl"], "seq_len": 512}, "data")

A leaf module (standard library only) so every room may import it, `models` and `data` included. It rejects
unknown keys (`data.seq_lenn: unknown key (known: sources, seq_len, ...)`) and wrong types
(`optim.lr: expected a number, got 'fast'`) by the full dotted key path, recursing into nested dataclasses, lists
and mappings. A dataclass may shape its raw mapping first and check itself after, with two optional hooks:

- `_prepare_mapping(cls, data, where) -> data` (classmethod): aliases and shorthands (`path:` for `paths:`);
- `_check_built(self, where)`: cross-field checks whose errors name `where`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def check_keys(data: Any, known: typing.Iterable[str], where: str) -> dict:
    """`data` itself when it is a mapping whose keys are all in `known`; else a one-line error naming the key."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: must be a mapping, got {data!r}")
    known = list(known)
    for key in data:
        if key not in known:
            raise ValueError(f"{_join(where, key)}: unknown key (known: {', '.join(known)})")
    return data


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def build(cls: type, data: Any, where: str = "") -> Any:
    """A dataclass from a mapping (None: all defaults; an instance of `cls` passes through), converting each field
    by its type hint; errors name the dotted key under `where`."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    prepare = getattr(cls, "_prepare_mapping", None)
    if prepare is not None:
        data = prepare(data, where)
    check_keys(data, field_names(cls), where)
    hints = typing.get_type_hints(cls)
    obj = cls(**{k: convert(v, hints[k], _join(where, k)) for k, v in data.items()})
    check = getattr(obj, "_check_built", None)
    if check is not None:
        check(where)
    return obj


def convert(value: Any, tp: Any, key: str) -> Any:
    """`value` checked (and, for float/str/dataclasses, converted) against the type hint `tp`; errors name `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(value, a, key)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if errors else f"{key}: must not be null")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        (inner,) = typing.get_args(tp)
        return [convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        _, inner = typing.get_args(tp)
        return {k: convert(v, inner, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"{key}: unsupported type {tp}")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
