"""Evaluate a mindvl model folder with lmms-eval (eval-scoring.md §10): chat-type and simple-type model adapters.

    pip install "torch==<yours>" lmms-eval     # or 'mindvl[lmms]'; keeps your torch (README: Compatibility)
    pip uninstall -y torchvision               # unless it matches your torch build (PyPI's does not match a CPU one)
    lmms-eval --model mindvl --tasks ocrbench,chartqa --batch_size 8 \\
        --model_args pretrained=/ckpt/export,max_pixels=1003520

or in-process, without the registry (e.g. from a training script):

    from lmms_eval.evaluator import simple_evaluate
    from mindvl.eval.lmms_adapter import MindVLLMM
    simple_evaluate(model=MindVLLMM(pretrained="/ckpt/export"), tasks=["ocrbench"])

`--model mindvl` resolves through the `lmms_eval.models` entry point that mindvl's pyproject declares: its payload is
`manifest()`, which names two implementations over the same code:
- `MindVLLMM`, the chat class (`is_simple = False`), used by default: lmms-eval builds chat tasks, which give
  messages, and runs their generate_until requests. lmms-eval builds no loglikelihood request for chat tasks.
- `MindVLSimple`, the simple class (`is_simple = True`), used with `--force_simple`: lmms-eval then builds its
  classic tasks (doc_to_visual + doc_to_text), so loglikelihood (multiple-choice, e.g. `seedbench_ppl`) tasks run,
  and so do generation tasks, prompted with the task's text after the images:

    lmms-eval --model mindvl --force_simple --tasks seedbench_ppl --model_args pretrained=/ckpt/export

Model args (lmms-eval's `k=v,k2=v2` string; values cannot contain commas):
    pretrained      the model folder (`mindvl export`/`convert` layout); required
    tokenizer       a tokenizer folder, when the model folder has no tokenizer.json
    device, dtype   default: cuda if available (bfloat16), else cpu (float32); dtype: bfloat16|float16|float32
    batch_size      requests per generate / forward call (packed into one row, no padding; generate_until sorts
                    each group's requests by length first, mindvl.infer.batching)
    min_pixels, max_pixels
                    the image resolution range; default: the folder's preprocessor_config.json, else Qwen2-VL's
    system          the system turn when a task gives none; default Qwen's "You are a helpful assistant.", "none"
                    for no system turn
    max_new_tokens  the budget when a task's gen_kwargs set none (default 128, as `mindvl eval`)
    seed            the sampling seed (sampled generation only); default: torch's initial seed, which lmms-eval's
                    --seed sets

Prompts are exactly those of `mindvl.infer.chat`: Qwen2-VL's ChatML with each image's pad run expanded, images
resized by `smart_resize` within [min_pixels, max_pixels], `<|im_start|>assistant\\n` as the generation prompt.
`loglikelihood` scores a continuation as the assistant's answer to the context (the user turn, images first), from
one teacher-forced forward, tokenized as training tokenizes an answer, the closing `<|im_end|>` not included. It
returns what lmms-eval's own models return and its scoring expects: the mean negative log-likelihood per
continuation token (a loss: lmms-eval's multiple-choice picks the option with the *smallest* value, its
`perplexity` metric reads it as is), and whether greedy decoding would produce the continuation. `batch_size`
requests share one packed forward, which materialises the logits of every token of every packed request
([T, vocab]): lower batch_size if that runs out of memory.

lmms-eval is an optional dependency. This module imports without it; `MindVLLMM` is built on first access as a
subclass of `lmms_eval.api.model.lmms` (what lmms-eval's registry checks), and where lmms-eval is missing the name
gives a stand-in whose construction raises an ImportError that says what to install.

Not supported: multi-round generation, beam search, videos and audio, and multi-process (accelerate/torchrun) launch;
each fails with a message rather than giving different numbers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mindvl.data.schema import IGNORE_INDEX, IMAGE_PLACEHOLDER, ROLES, Message
from mindvl.data.template import DEFAULT_SYSTEM, encode_conversation
from mindvl.eval.runner import FALLBACK_MAX_NEW_TOKENS, SORT_WINDOW, truncate_at_stop
from mindvl.infer.batching import generate_sorted
from mindvl.infer.chat import (
    conversation_prompt,
    folder_processing,
    load_for_chat,
    pixel_limits,
    process_images,
    stop_ids,
    user_message,
)
from mindvl.infer.generate import Prompt, pack_prompts

# MindVLLMM and MindVLSimple are provided by the module __getattr__ below (built on first access).
__all__ = ["MindVLLMM", "MindVLSimple", "Sampling",  # noqa: F822
           "manifest", "messages_to_conversation", "sampling_from_gen_kwargs"]

log = logging.getLogger(__name__)

MODEL_ID = "mindvl"
CLASS_PATH = f"{__name__}.MindVLLMM"
SIMPLE_CLASS_PATH = f"{__name__}.MindVLSimple"
INSTALL_HINT = ("pip install lmms-eval \"torch==<your torch version>\" (or 'mindvl[lmms]'), then remove a torchvision "
                "that does not match your torch (README: Compatibility)")

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


# ----------------------------------------------------------------------------------------------- registration


def manifest():
    """The payload of the `lmms_eval.models` entry point: `--model mindvl` -> `MindVLLMM` (chat type), and with
    `--force_simple` -> `MindVLSimple` (simple type, for loglikelihood tasks)."""
    from lmms_eval.models.registry_v2 import ModelManifest  # lmms-eval calls this, so it is importable here

    return ModelManifest(model_id=MODEL_ID, chat_class_path=CLASS_PATH, simple_class_path=SIMPLE_CLASS_PATH)


def _lmms_base() -> type:
    try:
        from lmms_eval.api.model import lmms
    except ImportError as err:
        raise ImportError(f"mindvl's lmms-eval adapter needs lmms-eval: {INSTALL_HINT} ({err})") from err
    return lmms


# One adapter class per (base class object, name): a test (or a re-installed lmms-eval) that swaps the package gets a
# class that subclasses the `lmms` it will be validated against.
_CLASSES: dict[tuple[type, str], type] = {}


def _adapter_class(name: str = "MindVLLMM") -> type:
    base = _lmms_base()
    cls = _CLASSES.get((base, name))
    if cls is None:
        impl = _IMPLEMENTATIONS[name]
        # The implementation first, so its methods fill lmms' abstract ones.
        cls = type(name, (impl, base), {"is_simple": impl.is_simple, "__module__": __name__, "__doc__": impl.__doc__})
        cls.__qualname__ = name
        _CLASSES[(base, name)] = cls
    return cls


def _unavailable(name: str) -> type:
    """Stands in for an adapter class where lmms-eval is not importable: constructing it raises ImportError with the
    install command (or, if lmms-eval has become importable since, builds the real adapter)."""

    class Unavailable:
        is_simple = _IMPLEMENTATIONS[name].is_simple

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return _adapter_class(name)(*args, **kwargs)

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> Any:
            return _adapter_class(name).create_from_arg_string(arg_string, additional_config)

    Unavailable.__name__ = Unavailable.__qualname__ = f"{name}Unavailable"
    return Unavailable


def __getattr__(name: str) -> Any:
    # The adapter classes are built lazily so that importing this module (and lmms-eval loading the entry point)
    # never needs lmms-eval's base class before it exists.
    if name in ("MindVLLMM", "MindVLSimple"):
        try:
            return _adapter_class(name)
        except ImportError:
            return _unavailable(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------- requests


def _field(obj: Any, name: str) -> Any:
    """A key of a dict, or an attribute of lmms_eval.protocol's pydantic objects."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def messages_to_conversation(messages: Any) -> tuple[list[Message], list[Any]]:
    """lmms-eval chat messages -> (mindvl messages with `<image>` placeholders, the images in order).

    `messages` is what a task's `doc_to_messages` returns: a list of `{"role", "content"}` dicts whose content is a
    string or a list of `{"type": "image", "url": PIL}` / `{"type": "text", "text": str}` items (a
    `lmms_eval.protocol.ChatMessages` or its pydantic messages work too). Items are kept in order with nothing added
    between them, as Qwen2-VL's chat template renders them.
    """
    if _field(messages, "messages") is not None and not isinstance(messages, list | tuple):
        messages = _field(messages, "messages")  # a ChatMessages object
    out: list[Message] = []
    images: list[Any] = []
    for message in messages or ():
        role = _field(message, "role")
        if role not in ROLES:
            raise ValueError(f"message role {role!r} is not one of {', '.join(ROLES)}")
        content = _field(message, "content")
        items = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or ())
        parts = []
        for item in items:
            kind = _field(item, "type")
            if kind == "text":
                text = _field(item, "text") or ""
                if IMAGE_PLACEHOLDER in text:
                    # mindvl marks image slots with this string; a literal one in the text would take an image's place.
                    raise ValueError(f"the prompt text contains {IMAGE_PLACEHOLDER!r}, which mindvl reserves for "
                                     "image slots; give images as {'type': 'image'} content items")
                parts.append(text)
            elif kind == "image":
                image = _field(item, "url")
                image = image if image is not None else _field(item, "image")
                if image is None:
                    raise ValueError("an image content item carries no image (expected its 'url' or 'image')")
                images.append(image)
                parts.append(IMAGE_PLACEHOLDER)
            elif kind in ("video", "audio"):
                raise NotImplementedError(f"mindvl's lmms-eval adapter takes images and text; this task gives {kind}")
            else:
                raise ValueError(f"unknown message content type {kind!r} (expected 'image' or 'text')")
        out.append(Message(role, "".join(parts)))
    if not out or out[-1].role != "user":
        raise ValueError("the messages must end with a user turn (the model answers it)")
    return out, images


def _flatten_visuals(visuals: Any) -> list[Any]:
    """`doc_to_visual(doc)` -> a flat image list: it may be None, one image, or (nested) lists of images."""
    if visuals is None:
        return []
    if not isinstance(visuals, list | tuple):
        return [visuals]
    return [image for v in visuals for image in _flatten_visuals(v)]


def _user_turn(context: str, n_images: int) -> Message:
    """A classic task's context -> the user turn: its `<image>` marks hold the images when they count them all
    (some tasks write them for LLaVA-style models); otherwise the marks are dropped and the images go first."""
    if context.count(IMAGE_PLACEHOLDER) != n_images:
        context = context.replace(IMAGE_PLACEHOLDER, "")
    return user_message(context, n_images)


@dataclass(frozen=True)
class Sampling:
    """How one group of generate_until requests is decoded (mindvl.infer.generate's arguments)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    until: list[str] = field(default_factory=list)


def sampling_from_gen_kwargs(gen_kwargs: dict[str, Any] | None, default_max_new_tokens: int) -> Sampling:
    """lmms-eval's gen_kwargs -> `Sampling`, with transformers' meaning: `do_sample=False` is greedy whatever the
    temperature, `do_sample=True` without a temperature samples at 1.0, and without `do_sample` a temperature > 0
    samples (what lmms-eval's Qwen models do). None values mean "unset"."""
    kw = dict(gen_kwargs or {})
    num_beams = int(kw.get("num_beams") or 1)
    if num_beams > 1:
        raise NotImplementedError(f"mindvl's lmms-eval adapter has no beam search (num_beams={num_beams})")
    max_new_tokens = int(kw.get("max_new_tokens") or default_max_new_tokens)
    temperature = float(kw.get("temperature") or 0.0)
    do_sample = kw.get("do_sample")
    if do_sample is not None and not do_sample:
        temperature = 0.0
    elif do_sample and temperature == 0:
        temperature = 1.0
    until = kw.get("until") or []
    if isinstance(until, str):
        until = [until]
    elif not isinstance(until, list | tuple):
        raise ValueError(f"gen_kwargs['until'] must be a string or a list of strings, got {type(until).__name__}")
    if temperature == 0:  # greedy: nucleus/top-k settings do not apply (and must not fail validation)
        return Sampling(max_new_tokens, until=list(until))
    top_p = kw.get("top_p")
    return Sampling(max_new_tokens, temperature, 1.0 if top_p is None else float(top_p), int(kw.get("top_k") or 0),
                    list(until))


def _through_lmms_evaluator(pairs: list[tuple[float, bool]]) -> list[Any]:
    """(log-likelihood, greedy) pairs in a form lmms-eval's evaluator hands to the task's scoring unchanged.

    lmms-eval 0.7 passes every model output through `unwrap_generation_output`, which keeps text and turns anything
    else into its str(): the pairs would reach multiple-choice scoring as strings ("too many values to unpack").
    Its `GenerationResult` wrapper is unwrapped as is, so where plain pairs do not survive they travel in one.
    """
    try:
        from lmms_eval.api.instance import GenerationResult, unwrap_generation_output
    except ImportError:  # lmms-eval before 0.7 (or a stand-in): outputs are used as returned
        return pairs
    if unwrap_generation_output((0.0, True))[0] == (0.0, True):
        return pairs
    return [GenerationResult(text=pair) for pair in pairs]  # type: ignore[arg-type]


def _group_key(gen_kwargs: dict[str, Any] | None) -> str:
    # gen_kwargs hold lists (`until`), so they are compared by a canonical dump rather than hashed.
    return json.dumps(gen_kwargs or {}, sort_keys=True, default=repr)


def _progress(total: int, disable: bool, desc: str):
    try:
        from tqdm import tqdm  # an lmms-eval dependency, so present wherever this adapter runs for real
    except ImportError:
        return None
    return tqdm(total=total, disable=disable, desc=desc)


# ----------------------------------------------------------------------------------------------- the adapter


class _MindVLLMMImpl:
    """lmms-eval chat model over a mindvl model folder: `generate_until` by mindvl's KV-cache generation (requests
    with the same gen_kwargs batched `batch_size` at a time), `loglikelihood` by a teacher-forced forward. See the
    module docstring for the model args."""

    is_simple = False

    def __init__(self, pretrained: str, tokenizer: str | None = None, device: str | None = None,
                 batch_size: int | str = 1, min_pixels: int | None = None, max_pixels: int | None = None,
                 system: str | None = DEFAULT_SYSTEM, max_new_tokens: int = FALLBACK_MAX_NEW_TOKENS,
                 dtype: str | None = None, seed: int | None = None, **kwargs: Any) -> None:
        self.pretrained = str(pretrained)  # before lmms.__init__, which names its cache folder after it
        super().__init__()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # lmms-eval shards requests by rank and gathers through an accelerator object this adapter lacks; every
            # process would evaluate everything. One process per model instead.
            raise ValueError("mindvl's lmms-eval adapter runs in a single process; launch lmms-eval without "
                             "accelerate/torchrun (WORLD_SIZE > 1)")
        if kwargs:
            log.warning("mindvl lmms-eval adapter: ignoring unknown model args %s", sorted(kwargs))
        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r} ('auto' is not "
                             "supported)") from None
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        self.max_new_tokens = int(max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        torch_dtype = None
        if dtype is not None and str(dtype).lower() != "auto":
            if str(dtype).lower() not in _DTYPES:
                raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
            torch_dtype = _DTYPES[str(dtype).lower()]
        # The model first: its folder's processor (16-px patches for Qwen3-VL) sets the pixel defaults and the rows.
        self.model, self.tokenizer = load_for_chat(self.pretrained, tokenizer, device, torch_dtype)
        self.processing = folder_processing(self.pretrained, self.model)
        lo, hi = pixel_limits(self.pretrained, self.processing)
        self.min_pixels = int(min_pixels) if min_pixels is not None else lo
        self.max_pixels = int(max_pixels) if max_pixels is not None else hi
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        # lmms-eval's arg parser turns "False"/"None"-like strings into values; all of them mean "no system turn".
        no_system = system is None or system is False or str(system).strip().lower() in ("none", "")
        self.system: str | None = None if no_system else str(system)
        self.seed = None if seed is None else int(seed)
        self.device = self.model.language_model.embed_tokens.weight.device
        self._stops = stop_ids(self.tokenizer)

    # ----------------------------------------------------------------------------------------------- helpers

    def _doc(self, task: str, split: str, doc_id: int) -> Any:
        return self.task_dict[task][split][doc_id]

    def _check_images(self, images: Sequence[Any]) -> None:
        if images and self.model.visual is None:
            raise ValueError("this is a text-only model (no vision tower); it cannot take the task's images")

    @staticmethod
    def _gen_kwargs(args: tuple) -> dict[str, Any] | None:
        return args[2]  # a chat task's generate_until: (ctx, doc_to_messages, gen_kwargs, doc_id, task, split)

    def _visual_inputs(self, doc_to_visual: Any, doc: Any) -> tuple[torch.Tensor | None, list, int]:
        """A simple task's doc_to_visual -> (pixel rows, grids, number of images)."""
        images = _flatten_visuals(doc_to_visual(doc) if callable(doc_to_visual) else None)
        self._check_images(images)
        pixels, grids = process_images(images, self.min_pixels, self.max_pixels, self.processing)
        return pixels, grids, len(images)

    def _chat_prompt(self, args: tuple) -> Prompt:
        """A generate_until request -> the prompt `mindvl.infer.chat` would build for its messages."""
        _ctx, doc_to_messages, _gen_kwargs, doc_id, task, split = args
        if not callable(doc_to_messages):
            raise TypeError("a chat-model request needs a doc_to_messages callable (lmms-eval's chat task path)")
        messages, images = messages_to_conversation(doc_to_messages(self._doc(task, split, doc_id)))
        self._check_images(images)
        pixels, grids = process_images(images, self.min_pixels, self.max_pixels, self.processing)
        return conversation_prompt(self.tokenizer, messages, pixels, grids, self.system)

    def _scoring_input(self, args: tuple) -> tuple[Prompt, int, int]:
        """A loglikelihood request -> (context + continuation as one prompt, start and end of the continuation).

        The continuation is rendered as the assistant's answer and tokenized exactly as training renders one
        (`encode_conversation`: the `assistant\\n` header and the answer are one text chunk), so its tokens are
        the labelled ones; the `<|im_end|>` that closes the answer is not part of it and is left off.
        """
        contexts, doc_to_target, doc_to_visual, doc_id, task, split = args
        doc = self._doc(task, split, doc_id)
        # multiple_choice tasks pass each option as the string itself; other tasks a doc_to_target callable.
        continuation = doc_to_target if isinstance(doc_to_target, str) else doc_to_target(doc)
        if not isinstance(continuation, str):
            raise TypeError(f"loglikelihood needs a string continuation, got {type(continuation).__name__}")
        context = contexts[0] if isinstance(contexts, list | tuple) else contexts
        pixels, grids, n_images = self._visual_inputs(doc_to_visual, doc)
        messages = [_user_turn(context, n_images), Message("assistant", continuation)]
        enc = encode_conversation(self.tokenizer, messages, grids, default_system=self.system)
        labelled = np.flatnonzero(enc.labels != IGNORE_INDEX)
        start, end = int(labelled[0]), int(labelled[-1])  # labelled[-1] is the answer's <|im_end|>
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None
        return Prompt(torch.from_numpy(enc.input_ids[:end]), pixels, grid), start, end

    def _batch_seed(self, index: int) -> int:
        base = self.seed if self.seed is not None else torch.initial_seed()
        return (base + index) % 2**63

    def _decode(self, ids: list[int]) -> str:
        if ids and ids[-1] in self._stops:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # --------------------------------------------------------------------------------------- lmms interface

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """Answers in request order. Requests with equal gen_kwargs are generated together: read SORT_WINDOW
        batches at a time, sorted by length, `batch_size` per generate call (mindvl.infer.batching); each answer is
        cut at the first of the task's `until` strings."""
        answers: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(_group_key(self._gen_kwargs(request.args)), []).append(i)
        bar = _progress(len(requests), getattr(self, "rank", 0) != 0, "mindvl generate_until")
        batch_index = 0
        for indices in groups.values():
            gen_kwargs = self._gen_kwargs(requests[indices[0]].args)
            sampling = sampling_from_gen_kwargs(gen_kwargs, self.max_new_tokens)
            for start in range(0, len(indices), self.batch_size * SORT_WINDOW):
                window = indices[start:start + self.batch_size * SORT_WINDOW]
                prompts = [self._chat_prompt(requests[i].args) for i in window]

                def done(batch: list[int], outputs: list[list[int]], window: list[int] = window,
                         until: Sequence[str] = sampling.until) -> None:
                    for j, ids in zip(batch, outputs, strict=True):
                        answers[window[j]] = truncate_at_stop(self._decode(ids), until)
                    if bar is not None:
                        bar.update(len(batch))

                # length-sorted batches of at most batch_size prompts; batch k samples with the seed's k-th step
                generate_sorted(self.model, prompts, sampling.max_new_tokens, max_batch=self.batch_size,
                                on_batch=done, seed=self._batch_seed(batch_index), temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, stop_token_ids=self._stops)
                batch_index += len(window)
        if bar is not None:
            bar.close()
        return answers

    @torch.inference_mode()
    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """(mean negative log-likelihood of the continuation tokens given the context, whether greedy decoding
        would produce exactly those tokens) per request, as lmms-eval's models return it (see the module
        docstring). `batch_size` requests share one packed forward."""
        results: list[tuple[float, bool]] = []
        bar = _progress(len(requests), getattr(self, "rank", 0) != 0, "mindvl loglikelihood")
        for first in range(0, len(requests), self.batch_size):
            chunk = requests[first:first + self.batch_size]
            inputs = [self._scoring_input(request.args) for request in chunk]
            packed = pack_prompts([prompt for prompt, _, _ in inputs], self.device)
            # The packed form: samples attend only within themselves, so each row is its own full forward.
            logits = self.model(input_ids=packed["input_ids"], cu_seqlens=packed["cu_seqlens"],
                                pixel_values=packed["pixel_values"], image_grid_thw=packed["image_grid_thw"]).logits
            offset = 0
            for prompt, start, end in inputs:
                if end > start:
                    # Position p predicts token p + 1: the continuation [start, end) is scored by rows [start-1, end-1).
                    scores = logits[offset + start - 1:offset + end - 1].float()
                    targets = prompt.input_ids[start:end].to(self.device)
                    loss = -float(scores.log_softmax(-1).gather(-1, targets[:, None]).sum()) / (end - start)
                    greedy = bool((scores.argmax(-1) == targets).all())
                else:  # an empty continuation: probability 1, trivially greedy
                    loss, greedy = 0.0, True
                results.append((loss, greedy))
                offset += len(prompt.input_ids)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return _through_lmms_evaluator(results)

    def generate_until_multi_round(self, requests: Iterable[Any]) -> list[str]:
        raise NotImplementedError("mindvl's lmms-eval adapter does not implement generate_until_multi_round "
                                  "(multi-round tasks); it evaluates generate_until and loglikelihood tasks")


class _MindVLSimpleImpl(_MindVLLMMImpl):
    """lmms-eval simple model over a mindvl model folder (`--force_simple`): the chat class's model, generation and
    scoring, fed by classic tasks: generate_until requests carry (context, gen_kwargs, doc_to_visual, doc_id, task,
    split) and are prompted as one user turn, the images first, then the context."""

    is_simple = True

    @staticmethod
    def _gen_kwargs(args: tuple) -> dict[str, Any] | None:
        return args[1]

    def _chat_prompt(self, args: tuple) -> Prompt:
        contexts, _gen_kwargs, doc_to_visual, doc_id, task, split = args
        context = contexts[0] if isinstance(contexts, list | tuple) else contexts
        pixels, grids, n_images = self._visual_inputs(doc_to_visual, self._doc(task, split, doc_id))
        return conversation_prompt(self.tokenizer, [_user_turn(context, n_images)], pixels, grids, self.system)


_IMPLEMENTATIONS: dict[str, type] = {"MindVLLMM": _MindVLLMMImpl, "MindVLSimple": _MindVLSimpleImpl}
