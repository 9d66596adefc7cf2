"""The `mindvl` argument parser: recipe overrides anywhere after the positionals, --version, a help text per flag."""

from __future__ import annotations

import argparse
import json

import pytest

import mindvl
from mindvl.cli import build_parser, main

# (sub-command argv before the overrides, the same with flags after the positionals): every command taking a recipe.
COMMANDS = {
    "train": ["train", "recipes/tiny/warmup.yaml"],
    "plan": ["plan", "recipes/tiny/multitask.yaml", "--world-size", "2", "--device", "h100-80g", "--sample-data"],
    "data plan": ["data", "plan", "recipes/tiny/warmup.yaml", "--probe", "5"],
    "ablate": ["ablate", "merge,lm-merge", "--seeds", "5", "--out", "runs/a"],
    "quickstart": ["quickstart", "--out", "runs/q", "--bench-items", "4"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_overrides_after_flags_are_collected_in_order(name):
    argv = COMMANDS[name]
    args = build_parser().parse_args([*argv, "optim.lr=5e-4", "max_steps=3"])
    assert args.overrides == ["optim.lr=5e-4", "max_steps=3"]
    # Before the flags, between them and after them: all collected, in command-line order.
    positional = 3 if name == "data plan" else 2
    head, flags = argv[:positional], argv[positional:]
    if name != "quickstart":  # quickstart has no positional argument but the overrides
        args = build_parser().parse_args([*head, "a.b=1", *flags, "c=2"])
        assert args.overrides == ["a.b=1", "c=2"]


@pytest.mark.parametrize("extra", [["--nope"], ["stray"], ["--nope", "a=b"]])
def test_other_leftovers_are_still_errors(extra, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*COMMANDS["plan"], *extra])
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_commands_without_overrides_refuse_key_value(capsys):
    """`key=value` only moves into commands that take a recipe; elsewhere it is an unrecognized argument."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "runs/a", "--out", "m", "max_steps=3"])
    assert "unrecognized arguments: max_steps=3" in capsys.readouterr().err


def test_override_after_flags_reaches_the_recipe(tmp_path, capsys):
    """The README's `data plan` with an override after its flags: the budget printed is the override's."""
    rc = main(["data", "plan", "recipes/tiny/warmup.yaml", "--probe", "5", "--json", "budget.max_tokens=123456"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["budget_tokens"] == 123456 and plan["budget_from_recipe"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"mindvl {mindvl.__version__}"


def _actions(parser: argparse.ArgumentParser, name: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _actions(p, f"{name} {sub}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield name, action


def test_every_flag_has_help():
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, a in _actions(build_parser(), "mindvl")
               if not a.help]
    assert not missing, f"arguments without help text: {missing}"
