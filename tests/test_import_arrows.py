"""Every import arrow between mindvl's rooms is one the house plan allows (ARCHITECTURE.md §2), lazy ones included.

The walk parses each module with `ast` (no import is executed) and collects: top-level and function-level `import`
and `from ... import` statements (relative ones resolved), `importlib.import_module("mindvl.x")` with a literal name,
and child processes started with `-m mindvl.x` or `-c "<code>"` (the code is parsed the same way). A failure names
the file, the line and the arrow, e.g. `mindvl/train/preflight.py:25: train -> infer (mindvl.infer.chat)`.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "mindvl"

# Which room each top-level module or package of mindvl belongs to (ARCHITECTURE.md §2).
ROOMS = {
    "config": "config", "models": "models", "checkpoint": "checkpoint", "data": "data", "train": "train",
    "infer": "infer", "eval": "eval", "plan": "plan", "curate": "curate", "moe_analysis": "moe_analysis",
    "quickstart": "workflows", "quickstart_plan": "workflows", "ablate": "workflows", "cli": "cli",
    # Leaf modules that import nothing of mindvl, so every room may use them (a plan change: see LEAVES).
    "typed": "leaf", "conventions": "leaf", "progress": "leaf", "children": "leaf", "untrusted": "leaf",
    "compile_limit": "leaf",
}
LEAVES = {"leaf"}  # mindvl.typed (the one mapping -> dataclass converter), mindvl.conventions (shared constants),
# mindvl.progress (the progress display of long work: eval, search, planner trace, curation, synthetic data),
# mindvl.children (Python children start with the safe path), mindvl.untrusted (bounded reads of received files),
# mindvl.compile_limit (dynamo's recompile limit, raised for the decode step's and the training blocks' compiles)
ROOT = "root"  # mindvl/__init__.py (the version string)

# The "may import" column of ARCHITECTURE.md §2 (stdlib and third-party imports are not checked here).
ALLOWED: dict[str, set[str]] = {
    "config": {"data"},
    "models": set(),
    "checkpoint": {"models", "data"},
    "data": set(),
    "train": {"config", "models", "data", "checkpoint", "eval"},
    "infer": {"models", "data", "checkpoint"},
    "eval": {"infer", "data", "checkpoint"},
    "plan": {"train", "models", "data", "config", "checkpoint"},  # checkpoint: model folders' config.json
    "curate": {"data", "infer"},
    "moe_analysis": {"models", "checkpoint"},
    "workflows": {"train", "eval", "checkpoint", "data", "config", "infer"},  # recipes; the text probe generates
    "cli": set(ROOMS.values()) | {ROOT},
    "leaf": set(),
    ROOT: set(),
}

# Arrows the code takes that the plan does not (yet) allow: each is a proposed change to ARCHITECTURE.md §2, with
# why it is right. (from room, to room) -> why. Empty: the plan of 2026-11-26 allows every arrow the code takes.
PLAN_CHANGES: dict[tuple[str, str], str] = {}
# (Within a room arrows are free, e.g. ablate/ -> quickstart.py: both are workflows; module cycles are not.)


@dataclass(frozen=True)
class Arrow:
    file: str  # path relative to the repository root
    line: int
    source: str  # room of the importing module
    target: str  # room of the imported module
    module: str  # the imported module (dotted)
    how: str  # import | lazy import | import_module | subprocess

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} -> {self.target} ({self.module}, {self.how})"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """The room of a dotted mindvl module name; None for modules outside mindvl."""
    parts = module.split(".")
    if parts[0] != "mindvl":
        return None
    if len(parts) == 1:
        return ROOT
    return ROOMS.get(parts[1], f"unmapped:{parts[1]}")


def _is_module(dotted: str, root: Path) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve_from(node: ast.ImportFrom, current: str, is_package: bool, root: Path) -> list[str]:
    """The modules a `from X import a, b` reaches: X.a when it is a submodule, else X."""
    if node.level:
        base = current.split(".") if is_package else current.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    if not pkg.startswith("mindvl"):
        return [pkg]
    out = []
    for alias in node.names:
        sub = f"{pkg}.{alias.name}"
        out.append(sub if alias.name != "*" and _is_module(sub, root) else pkg)
    return out


_DASH_M = re.compile(r"-m\s+(mindvl(?:\.\w+)*)")


def imports_in(source: str, current: str, is_package: bool, root: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, how) for every mindvl import-like reference in `source`."""
    tree = ast.parse(source)
    found: list[tuple[int, str, str]] = []
    # what runs at import time (module and class bodies, `if TYPE_CHECKING:` and try blocks), not function bodies
    top_level: set[int] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        n = todo.pop()
        top_level.add(id(n))
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))
    for node in ast.walk(tree):
        how = "import" if id(node) in top_level else "lazy import"
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, how) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, m, how) for m in _resolve_from(node, current, is_package, root)]
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value, "import_module"))
        elif isinstance(node, (ast.List, ast.Tuple)):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, arg, elt in zip(values, values[1:], node.elts[1:], strict=False):
                if flag == "-m" and isinstance(arg, str):
                    found.append((elt.lineno, arg, "subprocess"))
                elif flag == "-c" and isinstance(arg, str):
                    try:
                        child = imports_in(arg, "__main__", False, root)
                    except SyntaxError:
                        continue
                    found += [(elt.lineno, m, "subprocess") for _, m, _ in child]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, m, "subprocess") for m in _DASH_M.findall(node.value)
                      if not node.value.lstrip().startswith(("python -m", "`"))]  # docstrings say `python -m x`
    return [(line, m, how) for line, m, how in found if m == "mindvl" or m.startswith("mindvl.")]


@functools.cache  # parsed once per tree (the package walk takes a few seconds)
def arrows(root: Path = PACKAGE_ROOT) -> list[Arrow]:
    """Every arrow between two rooms (and every child process that runs the CLI), once per file, line and module."""
    out: dict[Arrow, None] = {}
    for path in sorted(root.rglob("*.py")):
        current = module_name(path, root)
        source = room_of(current)
        for line, module, how in imports_in(path.read_text(), current, path.name == "__init__.py", root):
            target = room_of(module)
            if target is not None and (target != source or (how == "subprocess" and target == "cli")):
                out[Arrow(str(path.relative_to(root.parent)), line, source, target, module, how)] = None
    return list(out)


def module_cycles(root: Path = PACKAGE_ROOT) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (lazy imports included; child processes
    are not imports). A package importing its own submodules is no loop unless a submodule imports the package."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        current = module_name(path, root)
        graph[current] = {m for _, m, how in imports_in(path.read_text(), current, path.name == "__init__.py", root)
                          if how != "subprocess"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(cycles)


def violations(found: list[Arrow], plan_changes: dict[tuple[str, str], str] = PLAN_CHANGES) -> list[Arrow]:
    """Arrows the plan does not allow. A child process may run any module but the CLI (ARCHITECTURE.md §2: "a child
    process runs a module, e.g. python -m mindvl.plan, never the CLI"): it shares no import graph with its parent."""
    bad = []
    for a in found:
        if a.target in LEAVES and a.source not in LEAVES:
            continue
        if a.how == "subprocess":
            if a.target == "cli":
                bad.append(a)
            continue
        if a.target in ALLOWED.get(a.source, set()) or (a.source, a.target) in plan_changes:
            continue
        bad.append(a)
    return bad


def room_cycles(found: list[Arrow], plan_changes: dict[tuple[str, str], str] = PLAN_CHANGES) -> list[str]:
    """Pairs of rooms that import each other ("no two rooms import each other, lazily or not")."""
    pairs = {(a.source, a.target) for a in found if a.how != "subprocess" and a.target not in LEAVES}
    return sorted(f"{s} <-> {t}" for s, t in pairs if s < t and (t, s) in pairs)


def test_every_arrow_is_allowed_by_the_plan():
    bad = violations(arrows())
    assert not bad, "import arrows the plan does not allow:\n" + "\n".join(map(str, bad))


def test_no_two_rooms_import_each_other():
    cycles = room_cycles(arrows())
    assert cycles == [], "rooms importing each other: " + ", ".join(cycles)


def test_no_import_cycles_between_modules():
    assert module_cycles() == []


def test_every_module_is_in_a_room():
    unmapped = {module_name(p, PACKAGE_ROOT) for p in PACKAGE_ROOT.rglob("*.py")
                if str(room_of(module_name(p, PACKAGE_ROOT))).startswith("unmapped:")}
    assert not unmapped, f"modules of no room (add them to ROOMS and to ARCHITECTURE.md §2): {sorted(unmapped)}"


def test_the_plan_changes_are_still_needed():
    """An allow-list entry no arrow uses any more is stale: remove it (and its proposed plan change)."""
    used = {(a.source, a.target) for a in arrows()}
    assert not set(PLAN_CHANGES) - used, f"unused PLAN_CHANGES entries: {sorted(set(PLAN_CHANGES) - used)}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "mindvl"
    for rel, text in {"__init__.py": "", **files}.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


@pytest.mark.parametrize("planted, expected", [
    ("from mindvl.checkpoint.hf import load\n", "mindvl/models/bad.py:1: models -> checkpoint (mindvl.checkpoint.hf, "
                                                "import)"),
    ("def f():\n    from ..train import step\n", "mindvl/models/bad.py:2: models -> train (mindvl.train.step, "
                                                  "lazy import)"),
    ("import importlib\nm = importlib.import_module('mindvl.data.loader')\n",
     "mindvl/models/bad.py:2: models -> data (mindvl.data.loader, import_module)"),
    ("import sys\ncmd = [sys.executable, '-c', 'from mindvl.cli import main; main()']\n",
     "mindvl/models/bad.py:2: models -> cli (mindvl.cli, subprocess)"),
    ("cmd = ['python', '-m', 'mindvl.cli', 'plan']\n", "mindvl/models/bad.py:1: models -> cli (mindvl.cli, "
                                                       "subprocess)"),
])
def test_a_planted_bad_import_fails(tmp_path, planted, expected):
    root = _tree(tmp_path, {
        "models/__init__.py": "", "models/good.py": "import torch\nfrom . import other\n", "models/other.py": "",
        "checkpoint/__init__.py": "", "checkpoint/hf.py": "from mindvl.models import good\n",
        "train/__init__.py": "", "train/step.py": "from mindvl.models.good import x\n",
        "data/__init__.py": "", "data/loader.py": "", "cli/__init__.py": "",
        "models/bad.py": planted,
    })
    bad = violations(arrows(root), plan_changes={})
    assert [str(a) for a in bad] == [expected]


def test_allowed_arrows_and_child_processes_pass(tmp_path):
    root = _tree(tmp_path, {
        "models/__init__.py": "", "models/m.py": "",
        "train/__init__.py": "", "plan/__init__.py": "",
        "train/t.py": "import subprocess\nfrom mindvl.models import m\n"
                      "subprocess.run(['python', '-m', 'mindvl.plan', 'r.yaml'])\n",
        "plan/p.py": "def f():\n    from mindvl.train import t\n",
    })
    assert violations(arrows(root), plan_changes={}) == []
    assert room_cycles(arrows(root)) == []
    assert module_cycles(root) == []
    root2 = _tree(tmp_path / "b", {"train/__init__.py": "", "plan/__init__.py": "",
                                   "plan/p.py": "import mindvl.train.t\n",
                                   "train/t.py": "def f():\n    from ..plan import p\n"})
    assert room_cycles(arrows(root2)) == ["plan <-> train"]
    assert module_cycles(root2) == [["mindvl.plan.p", "mindvl.train.t"]]
