"""mindvl.eval.lmms_adapter against a stand-in lmms_eval package (lmms-eval itself is not a test dependency).

The stand-in has what the adapter and lmms-eval's registry touch: `api.model.lmms` (an ABC with the three abstract
methods and `create_from_arg_string`), request objects with `.args`, and `models.registry_v2.ModelManifest`.
Expected answers are computed independently: `mindvl.infer.chat.chat` for generation, and a plain full forward of
context + continuation tokens for log-likelihoods.
"""

from __future__ import annotations

import abc
import importlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_mindvl import tiny_model_folder

import mindvl.eval.lmms_adapter as adapter
from mindvl.data.template import DEFAULT_SYSTEM
from mindvl.infer.chat import chat, conversation_prompt, process_images, user_message

PIXELS = dict(min_pixels=3136, max_pixels=50176)
REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------ stand-in lmms_eval


@dataclass
class Instance:
    args: tuple


def _parse_args(arg_string: str) -> dict:
    """lmms-eval's `k=v,k2=v2` parsing: numbers become numbers, everything else stays a string."""
    out = {}
    for pair in filter(None, arg_string.split(",")):
        key, value = pair.split("=", 1)
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    return out


def fake_lmms_eval() -> dict[str, types.ModuleType]:
    class lmms(abc.ABC):  # noqa: N801 - lmms-eval's name
        is_simple = True

        def __init__(self) -> None:
            self._rank, self._world_size, self.task_dict = 0, 1, {}

        @abc.abstractmethod
        def loglikelihood(self, requests): ...

        @abc.abstractmethod
        def generate_until(self, requests): ...

        @abc.abstractmethod
        def generate_until_multi_round(self, requests): ...

        @classmethod
        def create_from_arg_string(cls, arg_string, additional_config=None):
            extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
            return cls(**_parse_args(arg_string), **extra)

        @property
        def rank(self):
            return self._rank

        @property
        def world_size(self):
            return self._world_size

    @dataclass(frozen=True)
    class ModelManifest:
        model_id: str
        simple_class_path: str | None = None
        chat_class_path: str | None = None
        aliases: tuple = ()

    modules = {name: types.ModuleType(name) for name in
               ("lmms_eval", "lmms_eval.api", "lmms_eval.api.model", "lmms_eval.api.instance", "lmms_eval.models",
                "lmms_eval.models.registry_v2")}
    for name in ("lmms_eval", "lmms_eval.api", "lmms_eval.models"):
        modules[name].__path__ = []
    modules["lmms_eval.api.model"].lmms = lmms
    modules["lmms_eval.api.instance"].Instance = Instance
    modules["lmms_eval.models.registry_v2"].ModelManifest = ModelManifest
    return modules


@pytest.fixture(scope="module")
def lmms_eval():
    with pytest.MonkeyPatch.context() as mp:
        modules = fake_lmms_eval()
        for name, module in modules.items():
            mp.setitem(sys.modules, name, module)
        yield modules


# ------------------------------------------------------------------------------------------------ the model


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny random MindVL on mindvl's default tokenizer, saved with it as `mindvl export` does."""
    return tiny_model_folder(tmp_path_factory.mktemp("lmms") / "model")


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


DOCS = [
    {"image": image(0, (70, 100)), "question": "What does the sign say?", "answer": " stop"},
    {"image": image(1, (56, 84)), "question": "How many cats?", "answer": "yes"},
    {"image": None, "question": "Name a colour.", "answer": " red"},
]


def doc_to_messages(doc: dict) -> list[dict]:
    """The shape of lmms-eval's auto-wrapped chat messages: images first, then the text."""
    content = [{"type": "image", "url": doc["image"]}] if doc["image"] is not None else []
    return [{"role": "user", "content": [*content, {"type": "text", "text": doc["question"]}]}]


def doc_to_visual(doc: dict) -> list[Image.Image]:
    return [doc["image"]] if doc["image"] is not None else []


@pytest.fixture(scope="module")
def lm(lmms_eval, folder):
    cls = adapter.MindVLLMM
    model = cls.create_from_arg_string(f"pretrained={folder},min_pixels=3136,max_pixels=50176",
                                       {"batch_size": 2, "device": "cpu", "max_batch_size": None})
    model.task_dict = {"toy": {"test": DOCS}}
    return model


# -------------------------------------------------------------------------------------------- registration


def test_import_and_construct_without_lmms_eval(monkeypatch):
    monkeypatch.setitem(sys.modules, "lmms_eval", None)  # as if not installed (even where it is)
    monkeypatch.delitem(sys.modules, adapter.__name__)  # a fresh import; the original comes back afterwards
    fresh = importlib.import_module(adapter.__name__)
    for cls in (fresh.MindVLLMM, fresh.MindVLSimple):
        with pytest.raises(ImportError, match=r"pip install lmms-eval"):
            cls(pretrained="/nowhere")
        with pytest.raises(ImportError, match=r"pip install lmms-eval"):
            cls.create_from_arg_string("pretrained=/nowhere")
    with pytest.raises(ImportError):
        fresh.manifest()


def test_manifest_resolves_to_a_chat_and_a_simple_lmms_subclass(lmms_eval):
    manifest = adapter.manifest()
    assert isinstance(manifest, lmms_eval["lmms_eval.models.registry_v2"].ModelManifest)
    assert manifest.model_id == "mindvl"
    # What lmms-eval's ModelRegistryV2.get_model_class does with each path, then its _validate_model_class checks.
    for path, simple, name in ((manifest.chat_class_path, False, "MindVLLMM"),
                               (manifest.simple_class_path, True, "MindVLSimple")):
        module_name, cls_name = path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), cls_name)
        assert isinstance(cls, type) and issubclass(cls, lmms_eval["lmms_eval.api.model"].lmms)
        assert cls.is_simple is simple and cls.__name__ == name
        assert cls is getattr(adapter, name)  # built once per base class


def test_pyproject_declares_the_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["lmms_eval.models"]["mindvl"] == "mindvl.eval.lmms_adapter:manifest"
    assert any(req.startswith("lmms-eval") for req in project["optional-dependencies"]["lmms"])


def test_constructor_args(lm, folder):
    assert (lm.batch_size, lm.min_pixels, lm.max_pixels, lm.system) == (2, 3136, 50176, DEFAULT_SYSTEM)
    assert lm.device == torch.device("cpu") and lm.pretrained == str(folder)
    with pytest.raises(NotImplementedError, match="generate_until_multi_round"):
        lm.generate_until_multi_round([])
    with pytest.raises(ValueError, match="batch_size"):
        type(lm)(pretrained=str(folder), batch_size="auto")


# ------------------------------------------------------------------------------------------------ requests


def test_messages_to_conversation():
    red, blue = image(5, (28, 28)), image(6, (28, 56))
    msgs = [{"role": "system", "content": "Be brief."},
            types.SimpleNamespace(role="user", content=[types.SimpleNamespace(type="text", text="Compare "),
                                                        types.SimpleNamespace(type="image", url=red),
                                                        {"type": "text", "text": " and "},
                                                        {"type": "image", "image": blue},
                                                        {"type": "text", "text": "."}])]
    messages, images = adapter.messages_to_conversation(types.SimpleNamespace(messages=msgs))  # a ChatMessages
    assert [(m.role, m.content) for m in messages] == [("system", "Be brief."),
                                                       ("user", "Compare <image> and <image>.")]
    assert images == [red, blue]
    with pytest.raises(NotImplementedError, match="video"):
        adapter.messages_to_conversation([{"role": "user", "content": [{"type": "video", "url": "a.mp4"}]}])
    with pytest.raises(ValueError, match="reserves"):
        adapter.messages_to_conversation([{"role": "user", "content": "see <image>"}])
    with pytest.raises(ValueError, match="end with a user turn"):
        adapter.messages_to_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])


def test_sampling_from_gen_kwargs():
    S = adapter.Sampling
    assert adapter.sampling_from_gen_kwargs({}, 128) == S(128)
    greedy = {"max_new_tokens": 16, "temperature": 0, "top_p": None, "num_beams": 1, "do_sample": False,
              "until": "\n\n"}
    assert adapter.sampling_from_gen_kwargs(greedy, 128) == S(16, until=["\n\n"])
    assert adapter.sampling_from_gen_kwargs({"temperature": 0.7, "do_sample": False}, 8) == S(8)
    assert adapter.sampling_from_gen_kwargs({"temperature": 0.7, "top_p": 0.9}, 8) == S(8, 0.7, 0.9)
    assert adapter.sampling_from_gen_kwargs({"do_sample": True, "top_k": 5}, 8) == S(8, 1.0, 1.0, 5)
    with pytest.raises(NotImplementedError, match="beam"):
        adapter.sampling_from_gen_kwargs({"num_beams": 4}, 8)


# ---------------------------------------------------------------------------------------------- generation


def test_generate_until_matches_chat_and_cuts_at_until(lm):
    def expected(doc: dict, system: str | None = DEFAULT_SYSTEM) -> str:
        images = [doc["image"]] if doc["image"] is not None else []
        return chat(lm.model, lm.tokenizer, doc["question"], images, system=system, max_new_tokens=6, **PIXELS)

    want = [expected(doc) for doc in DOCS]
    assert len(want[0]) >= 3, "the tiny model's answer is too short to place a stop string in"
    stop = want[0][1:3]
    greedy = {"max_new_tokens": 6, "temperature": 0, "do_sample": False}
    cut = {**greedy, "until": [stop, "never-there"]}

    def request(doc_id: int, gen_kwargs: dict) -> Instance:
        return Instance((DOCS[doc_id]["question"], doc_to_messages, gen_kwargs, doc_id, "toy", "test"))

    # Two gen_kwargs groups, interleaved: answers must come back in request order; the first group fills a batch
    # of two (both with images) plus a text-only remainder.
    requests = [request(0, greedy), request(0, cut), request(1, greedy), request(2, greedy)]
    got = lm.generate_until(requests)
    assert got == [want[0], want[0][:want[0].find(stop)], want[1], want[2]]
    assert cut == {**greedy, "until": [stop, "never-there"]}  # the task's gen_kwargs are not modified


def test_generate_until_without_system_turn(lmms_eval, folder, lm):
    bare = adapter.MindVLLMM.create_from_arg_string(f"pretrained={folder},system=none,min_pixels=3136,"
                                                    "max_pixels=50176,batch_size=1,device=cpu")
    bare.task_dict = lm.task_dict
    assert bare.system is None
    got = bare.generate_until([Instance(("", doc_to_messages, {"max_new_tokens": 6}, 0, "toy", "test"))])
    assert got == [chat(bare.model, bare.tokenizer, DOCS[0]["question"], [DOCS[0]["image"]], system=None,
                        max_new_tokens=6, **PIXELS)]


# ---------------------------------------------------------------------------------------------- likelihood


def hand_loglikelihood(lm, context: str, continuation: str, images: list) -> tuple[float, bool]:
    """-log P(continuation | chat prompt of context) per continuation token (lmms-eval's loss convention) from one
    full [1, T] forward."""
    pixels, grids = process_images(images, **PIXELS)
    prompt = conversation_prompt(lm.tokenizer, [user_message(context, len(images))], pixels, grids, DEFAULT_SYSTEM)
    cont = lm.tokenizer.encode(continuation)
    ids = torch.tensor([*prompt.input_ids.tolist(), *cont])
    with torch.no_grad():
        logits = lm.model(input_ids=ids[None], pixel_values=pixels, image_grid_thw=prompt.image_grid_thw).logits[0]
    n = len(prompt.input_ids)
    rows = logits[n - 1:len(ids) - 1].log_softmax(-1)
    target = torch.tensor(cont)
    return -float(rows[torch.arange(len(cont)), target].mean()), bool((rows.argmax(-1) == target).all())


def greedy_continuation(lm, context: str, images: list, n: int = 2) -> str:
    """The first n greedy tokens after the prompt, as a string that tokenizes back to them."""
    pixels, grids = process_images(images, **PIXELS)
    prompt = conversation_prompt(lm.tokenizer, [user_message(context, len(images))], pixels, grids, DEFAULT_SYSTEM)
    ids = prompt.input_ids.tolist()
    for _ in range(n):
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor(ids)[None], pixel_values=pixels,
                              image_grid_thw=prompt.image_grid_thw).logits[0, -1]
        ids.append(int(logits.argmax()))
    text = lm.tokenizer.decode(ids[-n:])
    assert lm.tokenizer.encode(text) == ids[-n:], "the greedy tokens do not survive a decode/encode round trip"
    return text


def test_loglikelihood_equals_a_full_forward(lm):
    doc0, doc1 = DOCS[0], DOCS[1]
    greedy = greedy_continuation(lm, doc1["question"], [doc1["image"]])
    requests = [
        Instance((doc0["question"], " A", doc_to_visual, 0, "toy", "test")),  # multiple_choice: a string option
        Instance((doc1["question"], lambda doc: doc["answer"], doc_to_visual, 1, "toy", "test")),  # a callable
        Instance((doc1["question"], greedy, doc_to_visual, 1, "toy", "test")),
        Instance((DOCS[2]["question"], " red", doc_to_visual, 2, "toy", "test")),  # text only
        Instance((doc0["question"], "", doc_to_visual, 0, "toy", "test")),  # empty continuation
    ]
    got = lm.loglikelihood(requests)  # batch_size 2: three packed forwards
    want = [hand_loglikelihood(lm, doc0["question"], " A", [doc0["image"]]),
            hand_loglikelihood(lm, doc1["question"], "yes", [doc1["image"]]),
            hand_loglikelihood(lm, doc1["question"], greedy, [doc1["image"]]),
            hand_loglikelihood(lm, DOCS[2]["question"], " red", []),
            (0.0, True)]
    for (logprob, is_greedy), (ref_logprob, ref_greedy) in zip(got, want, strict=True):
        assert logprob == pytest.approx(ref_logprob, rel=1e-5, abs=1e-4)
        assert is_greedy is ref_greedy
    assert [g for _, g in got] == [False, False, True, False, True]
    assert all(loss > 0 for loss, _ in got[:4])


@pytest.fixture(scope="module")
def simple_lm(lmms_eval, folder, lm):
    """The `--force_simple` class over the same folder (lmms-eval then builds classic doc_to_visual tasks)."""
    model = adapter.MindVLSimple.create_from_arg_string(f"pretrained={folder},min_pixels=3136,max_pixels=50176",
                                                        {"batch_size": 2, "device": "cpu"})
    model.task_dict = lm.task_dict
    return model


def test_simple_class_generates_what_chat_does(simple_lm):
    want = [chat(simple_lm.model, simple_lm.tokenizer, doc["question"], doc_to_visual(doc), max_new_tokens=6,
                 **PIXELS) for doc in DOCS]
    greedy = {"max_new_tokens": 6, "temperature": 0, "do_sample": False}
    # A classic request: (context, gen_kwargs, doc_to_visual, doc_id, task, split); an `<image>` mark in the context
    # (LLaVA-style tasks write one) holds the image.
    requests = [Instance((DOCS[0]["question"], greedy, doc_to_visual, 0, "toy", "test")),
                Instance(("<image>\n" + DOCS[1]["question"], greedy, doc_to_visual, 1, "toy", "test")),
                Instance((DOCS[2]["question"], greedy, doc_to_visual, 2, "toy", "test"))]
    got = simple_lm.generate_until(requests)
    assert got[0] == want[0] and got[2] == want[2]
    marked = chat(simple_lm.model, simple_lm.tokenizer, "<image>\n" + DOCS[1]["question"], doc_to_visual(DOCS[1]),
                  max_new_tokens=6, **PIXELS)
    assert got[1] == marked


def test_simple_class_scores_multiple_choice_options(simple_lm):  # lmms-eval picks the smallest loss
    doc = DOCS[0]
    options = [" A", " B", " stop"]
    got = simple_lm.loglikelihood([Instance((doc["question"], o, doc_to_visual, 0, "toy", "test")) for o in options])
    want = [hand_loglikelihood(simple_lm, doc["question"], o, [doc["image"]]) for o in options]
    for (logprob, is_greedy), (ref_logprob, ref_greedy) in zip(got, want, strict=True):
        assert logprob == pytest.approx(ref_logprob, rel=1e-5, abs=1e-4)
        assert is_greedy is ref_greedy


def test_generate_until_serves_a_deepseek_v3_model(lmms_eval, tmp_path):
    """A MindVL with a DeepSeek-V3 (MLA + MoE) decoder serves through the adapter (its MLA KV cache)."""
    folder = tiny_model_folder(tmp_path / "ds", moe=True)
    lm = adapter.MindVLLMM.create_from_arg_string(f"pretrained={folder},min_pixels=3136,max_pixels=50176,"
                                                  "batch_size=2,device=cpu")
    lm.task_dict = {"toy": {"test": DOCS}}
    assert lm.model.config.text.is_moe
    gen = {"max_new_tokens": 5, "temperature": 0, "do_sample": False}
    got = lm.generate_until([Instance(("", doc_to_messages, gen, i, "toy", "test")) for i in range(len(DOCS))])
    assert got == [chat(lm.model, lm.tokenizer, d["question"], doc_to_visual(d), max_new_tokens=5, **PIXELS)
                   for d in DOCS]


def test_a_qwen3_vl_folder_serves_16px_rows(lmms_eval, tmp_path):
    """A Qwen3-VL-towered folder: the adapter cuts images with the folder's processor (16-px rows, mean/std 0.5,
    its pixel limits), the rows transformers' Qwen3-VL image processor gives (tests/test_qwen3_vl_processor.py pins
    preprocess_image to it), and generates what `chat` does."""
    from mindvl.checkpoint import save_pretrained
    from mindvl.data.processors import processing_from_folder
    from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
    from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

    sp = load_tokenizer(None).special
    cfg = MindVLConfig(
        text=TextConfig(vocab_size=686, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mrope_section=[4, 2, 2],
                        mrope_interleaved=True),
        vision=VisionConfig(family="qwen3_vl", depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                            patch_size=16, hidden_act="gelu_pytorch_tanh", num_position_embeddings=16,
                            deepstack_visual_indexes=[0]),
        image_token_id=sp.image_pad, video_token_id=sp.video_pad, vision_start_token_id=sp.vision_start,
        vision_end_token_id=sp.vision_end)
    model = MindVL(cfg)
    model.init_weights(seed=1, std=0.1)
    folder = save_pretrained(model, tmp_path / "q3", side_files_from=DEFAULT_TOKENIZER_PATH.parent,
                             pixels=(32 * 32 * 4, 32 * 32 * 16))
    lm = adapter.MindVLLMM.create_from_arg_string(f"pretrained={folder},batch_size=2,device=cpu")
    lm.task_dict = {"toy": {"test": DOCS}}
    assert (lm.min_pixels, lm.max_pixels) == (4096, 16384)  # the folder's, in 32 x 32 tokens
    prompt = lm._chat_prompt(("", doc_to_messages, {}, 0, "toy", "test"))
    from mindvl.data.processors import preprocess_image

    rows, grid = preprocess_image(DOCS[0]["image"], processing_from_folder(folder))
    assert prompt.pixel_values.shape[1] == 1536 and torch.equal(prompt.pixel_values, torch.from_numpy(rows))
    # 70 x 100 in 32-px units within [4096, 16384]: 64 x 96 -> (1, 4, 6)
    assert prompt.image_grid_thw.tolist() == [list(grid)] == [[1, 4, 6]]
    gen = {"max_new_tokens": 4, "temperature": 0, "do_sample": False}
    got = lm.generate_until([Instance(("", doc_to_messages, gen, i, "toy", "test")) for i in range(2)])
    assert got == [chat(lm.model, lm.tokenizer, d["question"], doc_to_visual(d), max_new_tokens=4, min_pixels=4096,
                        max_pixels=16384, system=DEFAULT_SYSTEM) for d in DOCS[:2]]
