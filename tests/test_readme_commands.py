"""Every command line of README.md's fenced `bash` blocks runs as written, or is excluded here with the reason.

The commands that touch only local demo data run in README order in a scratch folder laid out like a checkout
(`recipes/` linked), exactly as written (only environment variables differ: a private synthetic-data cache).
The long ones (the quickstart, an ablation) run until they have shown their plan or started training and are then
interrupted with Ctrl-C: they must stop cleanly (exit 75) and say how to continue. A README command that is in
none of the lists fails `test_every_readme_command_is_listed`, so a new example cannot go unchecked.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLAN_TINY = ("mindvl plan recipes/tiny/warmup.yaml --world-size 2 --device custom:mem_gb=24,tflops=165,hbm_gbs=1000,"
             "intra_gbs=32,inter_gbs=12 --sample-data batch.global_batch_size=2")
DEMO_CORPUS = ("python -c \"from mindvl.curate.synth import pairs_corpus; "
               "pairs_corpus('data/demo-pairs', 200, n_files=4)\"")

# Run to completion, in this order (later ones read what earlier ones wrote); each with what its output must show.
RUN: dict[str, str] = {
    "mindvl --version": "mindvl ",
    "mindvl data synth --out data/synth --n 200 --seed 0 --tasks ocr,chart,grounding,doc": "wrote 200 samples",
    "mindvl data stats data/synth/data.jsonl --seq-len 4096": "trained tokens",
    "mindvl data stats data/synth/data.jsonl --seq-len 4096 --json": '"trained_tokens"',
    "mindvl data stats data/synth/data.jsonl --seq-len 4096 --processor qwen3_vl": "trained tokens",
    "mindvl data plan recipes/mindvl-8b/warmup.yaml": "",
    "mindvl train recipes/tiny/warmup.yaml output_dir=runs/a max_steps=20 checkpoint_every=5 resume=auto":
        "final model: runs/a/final",
    "mindvl train tiny/warmup max_steps=20": "final model: runs/tiny/warmup/final",
    "mindvl train --list": "tiny/warmup",
    "mindvl export runs/a --out models/a": "exported models/a",
    # issue 43: an adapter folder chats as its run's model, with the run's tokenizer and (no) system turn
    "mindvl train tiny/lora init_from=runs/tiny/warmup/final output_dir=runs/lora max_steps=5":
        "final model: runs/lora/final",
    'mindvl chat runs/lora/final/adapter --prompt "What number is shown?" --max-new-tokens 8':
        "system prompt none (no system turn): data.default_system of the training run, runs/lora/recipe.json",
    PLAN_TINY: "fits:",
    DEMO_CORPUS: "",
    "mindvl curate recipes/curation/demo.yaml --workers 2": "curated/demo/report.md",
}
# Needs the `curate` extra (CI installs it; without it these are skipped).
NEEDS = {"mindvl curate recipes/curation/demo.yaml --workers 2": ("faiss", "imagehash")}

# Started, then interrupted once `marker` has been printed: exit 75 and a message naming the command to rerun.
INTERRUPT: dict[str, str] = {
    "mindvl quickstart --out runs/quickstart": "[1/8] data",
    "mindvl ablate merge,lm-merge --seeds 5 --out runs/ablate-merge optim.lr=5e-4": "phase multitask:",
}

EXCLUDED: dict[str, str] = {
    "./quickstart": "creates .venv and pip-installs (network); the `mindvl quickstart` it runs is checked here, and "
                    "benchmarks/quickstart-fast-transcript.txt shows a whole `./quickstart --fast`",
    ".ci/run": "CI itself (a fresh venv and the whole suite)",
    "#!/bin/bash": "the SLURM batch script (needs SLURM); tests/train/test_requeue.py runs its loop, with `scontrol "
                   "requeue` as a rerun, on 2 torchrun processes",
    "python3 -m venv .venv && . .venv/bin/activate": "environment set-up",
    "scripts/install-cpu-torch": "installs packages (network); tests/test_install_cpu_torch.py checks what it "
                                 "asks pip for",
    'pip install -e ".[test,curate,ray]"': "installs packages (network)",
    'pip install -e ".[curate]"': "installs packages (network)",
    'pip install "torch==$(python -c \'import torch; print(torch.__version__.split("+")[0])\')" -e ".[lmms]"':
        "installs packages (network)",
    "pip uninstall -y torchvision": "changes the environment",
    "python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder": "the test suite itself",
    "mindvl convert --from-hf /models/Qwen2.5-VL-7B-Instruct --out out/qwen25vl-7b": "needs a real checkpoint",
    "mindvl convert --from-hf /models/Qwen3-8B --out out/qwen3-8b": "needs a real checkpoint",
    "mindvl convert --vision-from /models/Qwen2.5-VL-72B-Instruct --language-from /models/Qwen3-8B "
    "--out out/mindvl-8b --seed 0": "needs real checkpoints",
    "mindvl convert --to-hf out/qwen25vl-7b --out out/qwen25vl-7b-hf": "needs the converted 7B model",
    "mindvl convert --from-hf /models/Qwen3-VL-8B-Instruct --out out/qwen3vl-8b": "needs a real checkpoint",
    "mindvl convert --from-hf /models/Qwen3.5-27B --out out/qwen35-27b": "needs a real checkpoint",
    "mindvl convert --vision-from /models/Qwen3-VL-8B-Instruct --language-from /models/Qwen3-8B "
    "--out out/mindvl-q3vit-8b --seed 0": "needs real checkpoints",
    "torchrun --nproc_per_node 8 $(which mindvl) train recipes/mindvl-8b/warmup.yaml": "8 accelerators, real data",
    "torchrun --nnodes 32 --nproc_per_node 8 $(which mindvl) train recipes/mindvl-671b/sft.yaml": "256 accelerators",
    "mindvl plan recipes/mindvl-8b/sft-8k.yaml --world-size 8 --device h100-80g":
        "minutes of tracing at 8B on 2 cores (tests/plan checks the planner; the tiny plan above runs here)",
    "mindvl plan recipes/mindvl-8b/sft-8k.yaml --world-size 16 --device 910b2-64g --json": "minutes at 8B",
    "mindvl plan recipes/mindvl-8b/multitask.yaml --world-size 64 --device h100-80g --preset mindvl-671b":
        "minutes at 671B",
    'mindvl chat runs/quickstart/merged --image receipt.png --prompt "What is the total?" [--max-new-tokens 64]':
        "needs a finished quickstart and your image (tests/test_generation.py covers chat)",
    'mindvl chat models/a --video clip.mp4 --prompt "What happens?" [--video-fps 2]': "needs your video",
    "mindvl merge out/sft-2k out/sft-4k out/sft-8k --out out/merged [--weights 1,1,2]": "needs three SFT models "
                                                                                         "(the quickstart merges)",
    "mindvl merge out/mindvl-671b --language-model-from /models/DeepSeek-V3 --out out/m": "needs real checkpoints",
    "mindvl eval out/merged --bench ocrbench=/data/OCRBench --bench docvqa=/data/DocVQA --out evals/merged":
        "needs the benchmarks' files",
    "mindvl search-resolution sft2k=out/sft-2k sft8k=out/sft-8k merged=out/merged --bench chartqa=/data/ChartQA "
    "--out evals/search --grid paper": "needs models and ChartQA's files",
    "mindvl ablate all --seeds 4 --jobs 2 --out runs/ablate": "about 60 minutes on 2 cores (the merge,lm-merge "
                                                              "example is started here)",
    "mindvl moe-trace /models/Qwen3-30B-A3B --corpus corpus.jsonl --out trace.npz": "needs a real MoE checkpoint",
    "mindvl moe-analyze trace.npz --segments 4,16,64,256 --cache-ratios 0.5,1,2,4 --out analysis/":
        "needs a trace of a real model (tests/moe_analysis covers it)",
    "mindvl curate recipes/curation/captions.yaml --engine ray": "needs CLIP, LAION heads and a VLM",
    "mindvl curate recipes/curation/ocr.yaml --workers 8": "needs a scene-text corpus and Tesseract",
}


def readme_commands(text: str | None = None) -> list[str]:
    """The command lines of the fenced `bash` blocks: continuation lines joined, trailing `# comments` dropped."""
    text = (ROOT / "README.md").read_text() if text is None else text
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if block.startswith("#!"):  # a whole script (the SLURM batch script): one entry, named by its first line
            commands.append(block.splitlines()[0])
            continue
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = _strip_comment(line).strip()
            if line:
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def test_comment_stripping():
    assert readme_commands("```bash\nmindvl a x=1   # why\nmindvl b \\\n   --c 'd # e'\n```\n") == \
        ["mindvl a x=1", "mindvl b --c 'd # e'"]
    assert readme_commands("```bash\n#!/bin/bash\nOUT=x\nrm -f y\n```\n") == ["#!/bin/bash"]


def test_every_readme_command_is_listed():
    commands = readme_commands()
    listed = {**RUN, **INTERRUPT, **EXCLUDED}
    assert not [c for c in commands if c not in listed], "README commands neither run nor excluded"
    assert not [c for c in listed if c not in commands], "listed but not in README"


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this environment's mindvl
    env["MINDVL_CACHE"] = str(tmp / "cache")  # synthetic sets: generated once here, never in ~/.cache
    env["PYTHONUNBUFFERED"] = "1"  # lines as they are printed (the interrupted commands are watched for a marker)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A scratch folder laid out like the checkout's root: README paths (recipes/...) resolve as written."""
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "recipes").symlink_to(ROOT / "recipes", target_is_directory=True)
    return tmp


@pytest.mark.slow
def test_readme_commands_run(checkout):
    env = _env(checkout)
    for command, expected in RUN.items():
        missing = [m for m in NEEDS.get(command, ()) if not _importable(m)]
        if missing:
            continue  # its extra is not installed (CI installs it)
        t0 = time.perf_counter()
        done = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                              timeout=600)
        print(f"{time.perf_counter() - t0:6.1f} s  {command}")  # what each costs CI (pytest -s shows it)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{output[-3000:]}"
        assert expected in output, f"`{command}` did not print {expected!r}:\n{output[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("command", list(INTERRUPT))
def test_long_readme_commands_start_and_stop_cleanly(command, checkout):
    marker = INTERRUPT[command]
    # preexec: a suite started in the background (`nohup pytest ... &`) runs with SIGINT ignored, which its children
    # inherit and Python then leaves ignored: the command would never see the Ctrl-C this test sends.
    proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=checkout, env=_env(checkout),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    # A command that never prints its marker (nor exits) must not hang CI: killed after 5 minutes.
    watchdog = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if marker in line:
                break
        assert any(marker in line for line in lines), f"`{command}` never printed {marker!r}:\n{''.join(lines)}"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group, as on a terminal
        rest, _ = proc.communicate(timeout=300)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 75, f"`{command}` exited {proc.returncode} after Ctrl-C:\n{output[-3000:]}"
    assert f"to continue, run it again: {command}" in output or f"resume with: {command}" in output, output[-3000:]


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
