"""Every bad input of tests/bad_inputs.py through the real `mindvl` command: prints the markdown table of
benchmarks/RESULTS.md ("Bad input: one line each"): the input, the one line on stderr, the exit code.

    python benchmarks/bad_inputs_table.py [--only ID ...]

Scratch paths in the messages are shortened to `TMP/`."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bad_inputs import CASES, run_case  # noqa: E402
from tiny_mindvl import tiny_model_folder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="case ids (default: all)")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or c.id in args.only]
    print("| bad input | stderr (the one line) | exit |")
    print("|---|---|---|")
    failures = 0
    with tempfile.TemporaryDirectory() as root:
        model = tiny_model_folder(Path(root) / "model")
        for case in cases:
            tmp = Path(root) / case.id
            tmp.mkdir()
            proc, names = run_case(case, tmp, model)
            lines = proc.stderr.splitlines()
            ok = proc.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in names)
            failures += not ok
            shown = lines[-1] if len(lines) == 1 else f"({len(lines)} lines) " + (lines[-1] if lines else "")
            shown = shown.replace(str(tmp) + "/", "TMP/").replace(str(model), "MODEL").replace("|", "\\|")
            print(f"| {case.what} | `` {shown} `` | {proc.returncode}{'' if ok else ' (NOT one line / exit 2)'} |",
                  flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
