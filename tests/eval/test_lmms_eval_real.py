"""The real lmms-eval package runs mindvl folders (`lmms-eval --model mindvl`) on local parquet files.

lmms-eval is not a test dependency (CI does not install it: it pulls a torchvision that breaks beside a CPU torch,
see README "Compatibility"), so this module skips where it is absent. Run it by hand where `mindvl[lmms]` is
installed. Two tasks, written as lmms-eval task YAMLs (`--include_path`) over local parquet files and reusing
lmms-eval's own task functions:

- generation: lmms-eval's OCRBench task through the chat class (`--model mindvl`); the per-item predictions must
  equal `mindvl eval`'s on the same file, and so must the OCRBench score;
- multiple choice: lmms-eval's SEED-Bench perplexity task (loglikelihood requests) through the simple class
  (`--force_simple`); each option's score (mean negative log-likelihood per token, lmms-eval's convention) must
  equal a plain full forward of the model, and the accuracy the most likely options give.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_mindvl import tiny_model_folder

from mindvl.cli import main
from mindvl.data.template import DEFAULT_SYSTEM
from mindvl.eval.synth_bench import write_synthetic_benchmarks
from mindvl.infer.chat import conversation_prompt, load_for_chat, process_images, user_message

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None,
                       reason="lmms-eval is not installed (not a CI dependency); run by hand with mindvl[lmms]"),
]

N = 4
PIXELS = (3136, 50176)
OCR_TASK = """dataset_path: parquet
dataset_kwargs:
  data_files: {{test: {path}}}
task: mindvl_ocrbench_local
test_split: test
output_type: generate_until
doc_to_visual: !function utils.ocrbench_doc_to_visual
doc_to_text: !function utils.ocrbench_doc_to_text
doc_to_target: "answer"
generation_kwargs: {{max_new_tokens: 8, temperature: 0, top_p: 1.0, num_beams: 1, do_sample: false}}
process_results: !function utils.ocrbench_process_results
metric_list:
  - metric: ocrbench_accuracy
    aggregation: !function utils.ocrbench_aggregate_accuracy
    higher_is_better: true
lmms_eval_specific_kwargs: {{default: {{pre_prompt: "", post_prompt: ""}}}}
"""
SEED_TASK = """dataset_path: parquet
dataset_kwargs:
  data_files: {{test: {path}}}
task: mindvl_seedbench_ppl_local
test_split: test
output_type: multiple_choice
doc_to_visual: !function utils.seed_doc_to_visual
doc_to_text: !function utils.seed_doc_to_text_mc
doc_to_choice: !function utils.seed_doc_to_choice
doc_to_target: !function utils.seed_doc_to_mc_target
metric_list:
  - metric: acc
"""


def seed_docs() -> list[dict]:
    rng = np.random.default_rng(0)
    words = ["red", "blue", "a cat", "two dogs", "yes", "no", "seven", "the sign"]
    docs = []
    for i in range(N):
        choices = list(rng.choice(words, 4, replace=False))
        image = Image.fromarray(rng.integers(0, 256, (56 + 14 * i, 84, 3), dtype=np.uint8))
        docs.append({"question_id": str(i), "question": f"Question {i}: what is shown?", "data_type": "image",
                     "choice_a": choices[0], "choice_b": choices[1], "choice_c": choices[2], "choice_d": choices[3],
                     "answer": "ABCD"[i % 4], "image": [image]})
    return docs


def write_seed_parquet(path: Path, docs: list[dict]) -> Path:
    from datasets import Dataset, Features, Sequence, Value  # an lmms-eval dependency
    from datasets import Image as ImageFeature

    features = Features({**{k: Value("string") for k in docs[0] if k != "image"}, "image": Sequence(ImageFeature())})
    Dataset.from_list(docs, features=features).to_parquet(str(path))
    return path


def write_task(root: Path, name: str, yaml_text: str, utils_module: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / f"{name}.yaml").write_text(yaml_text)
    (folder / "utils.py").write_text(f"from {utils_module} import *  # noqa: F401,F403 (lmms-eval's task functions)\n")


def lmms_eval(cwd: Path, name: str, *args: str) -> Path:
    out = cwd / f"lmms-out-{name}"
    cmd = [sys.executable, "-m", "lmms_eval", "--batch_size", "2", "--device", "cpu", "--log_samples",
           "--output_path", str(out), "--include_path", str(cwd / "tasks"), *args]
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"*samples_{task}.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                  key=lambda s: s["doc_id"])


def first(response):
    """lmms-eval 0.7 logs one filtered response as itself; older versions as a one-item list."""
    return response[0] if isinstance(response, list) else response


def results(out: Path, task: str) -> dict:
    (path,) = out.rglob("*results.json")
    return json.loads(path.read_text())["results"][task]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmms-real")
    folder = tiny_model_folder(root / "model")
    ocr = write_synthetic_benchmarks(root / "bench", n=N, seed=3, benchmarks=["ocrbench"], ocr_task="digits")
    ocr_file = next(ocr["ocrbench"].glob("*.parquet"))
    docs = seed_docs()
    seed_file = write_seed_parquet(root / "seed.parquet", docs)
    write_task(root / "tasks", "mindvl_ocrbench_local", OCR_TASK.format(path=ocr_file),
               "lmms_eval.tasks.ocrbench.utils")
    write_task(root / "tasks", "mindvl_seedbench_ppl_local", SEED_TASK.format(path=seed_file),
               "lmms_eval.tasks.seedbench.utils")
    return root, folder, ocr["ocrbench"], docs


def test_generation_task_equals_mindvl_eval(setup):
    root, folder, ocr_dir, _ = setup
    args = f"pretrained={folder},min_pixels={PIXELS[0]},max_pixels={PIXELS[1]}"
    out = lmms_eval(root, "chat", "--model", "mindvl", "--tasks", "mindvl_ocrbench_local", "--model_args", args)
    theirs = [first(s["filtered_resps"]) for s in samples(out, "mindvl_ocrbench_local")]
    assert main(["eval", str(folder), "--bench", f"ocrbench={ocr_dir}", "--out", str(root / "mindvl-eval"),
                 "--max-new-tokens", "8", "--device", "cpu", "--min-pixels", str(PIXELS[0]),
                 "--max-pixels", str(PIXELS[1])]) == 0
    rows = [json.loads(line) for line in (root / "mindvl-eval" / "ocrbench" / "predictions.jsonl").read_text()
            .splitlines()]
    assert len(theirs) == len(rows) == N
    assert theirs == [r["prediction"] for r in rows]
    summary = json.loads((root / "mindvl-eval" / "summary.json").read_text())["results"]["ocrbench"]
    score = results(out, "mindvl_ocrbench_local")["ocrbench_accuracy,none"]
    assert score == pytest.approx(summary["ocrbench_accuracy"])  # 0 for a random model: the predictions carry it


def hand_loglikelihood(model, tok, context: str, continuation: str, image) -> float:
    pixels, grids = process_images([image], *PIXELS)
    prompt = conversation_prompt(tok, [user_message(context, 1)], pixels, grids, DEFAULT_SYSTEM)
    cont = tok.encode(continuation)
    ids = torch.tensor([*prompt.input_ids.tolist(), *cont])
    with torch.no_grad():
        logits = model(input_ids=ids[None], pixel_values=pixels, image_grid_thw=prompt.image_grid_thw).logits[0]
    rows = logits[len(prompt.input_ids) - 1:len(ids) - 1].log_softmax(-1)
    return -float(rows[torch.arange(len(cont)), torch.tensor(cont)].mean())  # lmms-eval's convention: a loss


def test_multiple_choice_task_runs_through_the_simple_class(setup):
    root, folder, _, docs = setup
    args = f"pretrained={folder},min_pixels={PIXELS[0]},max_pixels={PIXELS[1]}"
    out = lmms_eval(root, "simple", "--model", "mindvl", "--force_simple", "--tasks", "mindvl_seedbench_ppl_local",
                    "--model_args", args)
    got = samples(out, "mindvl_seedbench_ppl_local")
    model, tok = load_for_chat(folder, device="cpu")
    correct = 0
    for doc, sample in zip(docs, got, strict=True):
        choices = [doc[f"choice_{c}"] for c in "abcd"]
        want = [hand_loglikelihood(model, tok, f"{doc['question']} Answer :", " " + c, doc["image"][0])
                for c in choices]
        theirs = [float(r[0]) if isinstance(r, list) else float(r) for r in sample["filtered_resps"]]
        assert theirs == pytest.approx(want, rel=1e-5, abs=1e-4)
        correct += int(np.argmin(want)) == "ABCD".index(doc["answer"])  # the most likely option
    assert results(out, "mindvl_seedbench_ppl_local")["acc,none"] == pytest.approx(correct / N)
