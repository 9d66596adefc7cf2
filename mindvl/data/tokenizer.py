"""Text tokenizer: a local HuggingFace tokenizer folder, or mindvl's small shipped default.

Only the `tokenizers` library is needed (a HF folder's `tokenizer.json`); transformers is not imported. The
default tokenizer (`mindvl/assets/tokenizer/tokenizer.json`) is a byte-level BPE with Qwen2's pre-tokenizer and
Qwen's special tokens, in Qwen's order (`<|endoftext|>` first, `<|video_pad|>` last), so every special token sits at
the same offset from `<|endoftext|>` as in Qwen2.5-VL (151643 ... 151656). It is small (about 2k tokens) so the tiny
default model trains offline; it is rebuilt deterministically by `build_default_tokenizer()` (a test checks that the
shipped file is exactly what the builder produces).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2-VL / Qwen2.5-VL special tokens, in id order (151643 ... 151656 in the real vocabulary).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# The tokens the data pipeline cannot work without.
REQUIRED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")

# Qwen2's pre-tokenizer split pattern (from its tokenizer.json).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_TOKENIZER_PATH = Path(__file__).resolve().parent.parent / "assets" / "tokenizer" / "tokenizer.json"
DEFAULT_VOCAB_SIZE = 2048  # learned tokens; the 14 special tokens come on top

# Qwen2-VL's chat template, written beside a saved tokenizer so transformers renders prompts the same way.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens the template and the model need."""

    endoftext: int
    im_start: int
    im_end: int
    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int | None


class TextTokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the ids the chat template needs. Picklable."""

    def __init__(self, tokenizer: Tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name
        missing = [t for t in REQUIRED_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(
                f"tokenizer {name} lacks the special tokens {missing}; use a Qwen2-VL/Qwen2.5-VL/Qwen3 tokenizer or "
                "leave `tokenizer` unset for mindvl's default"
            )
        tid = tokenizer.token_to_id
        self.special = SpecialIds(
            endoftext=tid("<|endoftext|>"),
            im_start=tid("<|im_start|>"),
            im_end=tid("<|im_end|>"),
            vision_start=tid("<|vision_start|>"),
            vision_end=tid("<|vision_end|>"),
            image_pad=tid("<|image_pad|>"),
            video_pad=tid("<|video_pad|>"),
        )
        # Data text is text: a copy that encodes special-token strings found in text ("<|im_end|>" typed by a user)
        # as ordinary characters, like transformers' `split_special_tokens=True`. Only the chat template inserts
        # special tokens, by id.
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True

    def __getstate__(self) -> dict:
        return {"tokenizer": self.tokenizer.to_str(), "name": self.name}

    def __setstate__(self, state: dict) -> None:  # loader workers receive the tokenizer by pickle
        self.__init__(Tokenizer.from_str(state["tokenizer"]), state["name"])

    @property
    def vocab_size(self) -> int:
        """Size including added tokens (what an embedding table must hold)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, without BOS/EOS post-processing (special-token strings in the text are matched, as HF
        does when it tokenizes a rendered chat template)."""
        if not text:
            return []
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str):
        """Data text -> a `tokenizers.Encoding` (ids and character offsets) in which special-token strings are plain
        text, never special tokens."""
        return self._plain.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> None:
        """Write an HF-loadable folder: tokenizer.json + tokenizer_config.json (with Qwen2-VL's chat template)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "model_max_length": 131072,
            "chat_template": QWEN2_VL_CHAT_TEMPLATE,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def __repr__(self) -> str:
        return f"TextTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | os.PathLike | None = None) -> TextTokenizer:
    """Load a tokenizer from an HF folder (its tokenizer.json), a tokenizer.json file, or mindvl's default (None)."""
    if path is None:
        if not DEFAULT_TOKENIZER_PATH.is_file():
            raise FileNotFoundError(f"mindvl's default tokenizer is missing at {DEFAULT_TOKENIZER_PATH}; reinstall")
        return TextTokenizer(Tokenizer.from_file(str(DEFAULT_TOKENIZER_PATH)), "mindvl-default")
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {p}: expected a folder with tokenizer.json (a HuggingFace tokenizer saved with "
            "save_pretrained) or a tokenizer.json file"
        )
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:
        raise ValueError(f"cannot read tokenizer {file}: {exc}") from exc
    return TextTokenizer(tok, str(p))


def _training_corpus() -> list[str]:
    """A fixed, small English corpus in the style of VQA/caption/OCR instructions (deterministic)."""
    base = [
        "You are a helpful assistant.",
        "Describe this image in detail. What is shown in the picture?",
        "Read the text in the image. What does the sign say? The text reads:",
        "What is the value of the bar labelled {w}? The value is {n}.",
        "Which category has the highest value in the chart? The line chart shows the trend over the years.",
        "Locate the {c} {s} in the image and give its bounding box as (x1, y1, x2, y2).",
        "The {c} {s} is at ({n}, {n}, {n}, {n}).",
        "According to the document, what is the total amount? The invoice number is {n} and the date is 2024-{n}.",
        "Answer the question using a single word or phrase. Answer: yes. Answer: no.",
        "There are {n} people in the photo. A man is standing next to a red car on the street.",
        "The quick brown fox jumps over the lazy dog. A cat is sleeping on the sofa near the window.",
        "Please summarize the main points of the page. The title of the section is Introduction.",
        "Question: how many objects are there? Let's think step by step. First, count the circles.",
        "def main():\n    print('hello world')\n    return 0\n",
        "The table has three columns: name, price and quantity. The price of the item is ${n}.{n}.",
        "In 2023, revenue grew by {n}% compared to the previous year, reaching {n} million dollars.",
    ]
    colours = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "gray", "brown"]
    shapes = ["circle", "square", "triangle", "rectangle", "star", "box", "line", "point"]
    words = ["alpha", "beta", "sales", "total", "north", "south", "east", "west", "january", "march", "report"]
    corpus = []
    for i in range(400):
        t = base[i % len(base)]
        corpus.append(
            t.replace("{w}", words[i % len(words)])
            .replace("{c}", colours[(i * 7) % len(colours)])
            .replace("{s}", shapes[(i * 3) % len(shapes)])
            .replace("{n}", str((i * 37) % 1000))
        )
    corpus.append(" ".join(str(i) for i in range(200)))
    corpus.append("".join(chr(c) for c in range(32, 127)))
    return corpus


def build_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train mindvl's default byte-level BPE from the fixed corpus; the 14 Qwen special tokens go last."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_default_tokenizer(path: str | os.PathLike = DEFAULT_TOKENIZER_PATH) -> None:
    """Regenerate the shipped default tokenizer file (maintainers only)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    build_default_tokenizer().save(str(path))
