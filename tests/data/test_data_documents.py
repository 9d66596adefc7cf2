"""Record kinds beyond chats: interleaved documents, plain text, caption corpora (JSONL and WebDataset txt shards),
and the Show case: one pack holding a document, a video chat, an image chat and a text-only chat, its labels and
positions checked by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from data_helpers import png_bytes, qa, write_jsonl, write_tar

from mindvl.data import DataConfig, build_loader
from mindvl.data.captions import DEFAULT_CAPTION_PROMPTS, choose_prompt
from mindvl.data.schema import IGNORE_INDEX
from mindvl.data.video import write_test_video

PIX = {"min_pixels": 56 * 56, "max_pixels": 56 * 56}  # every image -> grid (1, 4, 4) -> 4 pads


def _loader(tmp_path, tok, records_or_path, **extra):
    path = records_or_path if not isinstance(records_or_path, list) else write_jsonl(tmp_path / "d.jsonl",
                                                                                     records_or_path)
    cfg = DataConfig.from_dict({"sources": [{"path": str(path), **extra.pop("source", {})}], "seq_len": 4096,
                                "pack_buffer": 16, **PIX, **extra})
    return build_loader(cfg, tok, max_epochs=1)


def _samples(pack):
    cu = pack.cu_seqlens.tolist()
    return [(pack.input_ids[a:b], pack.labels[a:b], pack.position_ids[:, a:b]) for a, b in itertools.pairwise(cu)]


def test_a_pack_with_a_document_a_video_an_image_chat_and_a_text_chat(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56, seed=1))
    # 8 frames at 4 fps, sampled at 2 fps: frames 0, 2, 4, 6 -> 2 temporal patches, sampled_fps 2,
    # second_per_grid_t = 2 / 2 = 1, time index of patch k = int(k * tokens_per_second(2) * 1) = 0, 2.
    write_test_video(tmp_path / "v.mp4", np.full((8, 56, 56, 3), 128, np.uint8), fps=4)
    records = [
        {"text": "Hello <image> world", "images": ["a.png"]},
        {**qa("<video>What?", "Grey."), "videos": ["v.mp4"]},
        qa("<image>Describe.", "Noise.", images=["a.png"]),
        qa("Hi", "Hello."),
    ]
    loader = _loader(tmp_path, tok, records, video={"min_pixels": 56 * 56, "max_pixels": 56 * 56})
    [pack] = list(loader)
    sp = tok.special
    assert pack.num_samples == 4 and pack.image_grid_thw.tolist() == [[1, 4, 4], [2, 4, 4], [1, 4, 4]]
    assert pack.pixel_values.shape == (16 + 32 + 16, 1176)
    (d_ids, d_lab, d_pos), (v_ids, v_lab, v_pos), (i_ids, i_lab, i_pos), (t_ids, t_lab, t_pos) = _samples(pack)

    # Document: "Hello" " " tokens, vision block, " world", <|endoftext|>; no chat template.
    head = tok.encode("Hello ")
    n = len(head)
    assert d_ids[:n].tolist() == head and d_ids[n] == sp.vision_start
    assert d_ids[n + 1:n + 5].tolist() == [sp.image_pad] * 4 and d_ids[n + 5] == sp.vision_end
    assert d_ids[n + 6:-1].tolist() == tok.encode(" world") and d_ids[-1] == sp.endoftext
    expected = d_ids.copy()
    expected[0] = IGNORE_INDEX  # nothing predicts the first token
    expected[n:n + 6] = IGNORE_INDEX  # vision_start, 4 pads, vision_end
    assert d_lab.tolist() == expected.tolist()
    # Positions: text 0..n, the 2x2 merged image at n+1 (t, rows, cols), the text after it from n+1+2.
    s = n + 1
    assert d_pos[:, :s].tolist() == [list(range(s))] * 3
    assert d_pos[:, s:s + 4].tolist() == [[s] * 4, [s, s, s + 1, s + 1], [s, s + 1, s, s + 1]]
    rest = len(d_ids) - (s + 4)
    assert d_pos[:, s + 4:].tolist() == [list(range(s + 2, s + 2 + rest))] * 3

    # Video chat: system + user header, the video block, then the question; labels on "Grey.<|im_end|>" only.
    pads = np.flatnonzero(v_ids == sp.video_pad)
    s = int(pads[0])
    assert len(pads) == 8 and pads.tolist() == list(range(s, s + 8)) and sp.image_pad not in v_ids
    assert v_pos[:, :s].tolist() == [list(range(s))] * 3
    assert v_pos[:, s:s + 8].tolist() == [[s] * 4 + [s + 2] * 4, [s, s, s + 1, s + 1] * 2, [s, s + 1] * 4]
    assert v_pos[0, s + 8] == s + 2  # vision_end: start + max(h, w)/2, not past the time axis
    assert v_pos[:, s + 8:].tolist() == [list(range(s + 2, s + 2 + len(v_ids) - s - 8))] * 3
    answer = tok.encode("Grey.") + [sp.im_end]
    trained = v_lab[v_lab != IGNORE_INDEX].tolist()
    assert trained == answer and v_lab[-1] == IGNORE_INDEX  # the newline after <|im_end|> is not trained

    # Image chat: 4 image pads, same position rule as the document's image.
    s = int(np.flatnonzero(i_ids == sp.image_pad)[0])
    assert i_pos[:, s:s + 4].tolist() == [[s] * 4, [s, s, s + 1, s + 1], [s, s + 1, s, s + 1]]
    assert i_lab[i_lab != IGNORE_INDEX].tolist() == tok.encode("Noise.") + [sp.im_end]

    # Text-only chat: positions 0..L-1 on all three rows.
    assert t_pos.tolist() == [list(range(len(t_ids)))] * 3
    assert t_lab[t_lab != IGNORE_INDEX].tolist() == tok.encode("Hello.") + [sp.im_end]


def test_obelics_lists_plain_text_and_bad_documents(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(png_bytes(40, 60))
    records = [
        {"texts": ["First paragraph.", None, "Second."], "images": [None, "a.png", None]},
        {"text": "Plain text for language preservation, with a literal <video> tag."},
        {"text": "Two markers <image> and <image> but one image.", "images": ["a.png"]},  # line 3
        {"text": "   "},
        {"texts": ["a", "b"], "images": [None]},
    ]
    loader = _loader(tmp_path, tok, records)
    samples = [s for p in loader for s in _samples(p)]
    assert len(samples) == 2
    texts = sorted(tok.decode(ids.tolist()) for ids, _, _ in samples)
    assert texts[0].startswith("First paragraph.\n\n<|vision_start|>") and texts[0].endswith("Second.<|endoftext|>")
    assert texts[1] == "Plain text for language preservation, with a literal <video> tag.<|endoftext|>"
    assert loader.report()["skipped"] == {"bad_record": 1, "empty_document": 1, "image_count_mismatch": 1}


def test_long_document_is_cut_before_an_image_block(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56))
    words = " ".join(["word"] * 40)
    records = [{"text": f"{words} <image> {words} <image> end", "images": ["a.png", "a.png"]}]
    cfg = DataConfig.from_dict({"sources": [{"path": str(write_jsonl(tmp_path / "d.jsonl", records))}],
                                "seq_len": 60, "pack_buffer": 2, **PIX})
    loader = build_loader(cfg, tok, max_epochs=1)
    [pack] = list(loader)
    ids = pack.input_ids
    first_block = int(np.flatnonzero(ids == tok.special.vision_start)[0])
    assert pack.num_tokens <= 60 and pack.image_grid_thw.tolist() == [[1, 4, 4]]  # the second image is dropped
    assert (ids == tok.special.vision_start).sum() == 1 and (ids == tok.special.vision_end).sum() == 1
    assert first_block < pack.num_tokens
    assert loader.report()["truncated"] == 1


def test_caption_records_jsonl_and_webdataset(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56))
    write_jsonl(tmp_path / "c.jsonl", [{"image": "a.png", "caption": f"caption {i}"} for i in range(12)])
    loader = _loader(tmp_path, tok, tmp_path / "c.jsonl", source={"caption_prompts": "default"})
    chats = [tok.decode(ids.tolist()) for p in loader for ids, _, _ in _samples(p)]
    used = {p for c in chats for p in DEFAULT_CAPTION_PROMPTS if f"<|vision_end|>{p}<|im_end|>" in c}
    assert len(chats) == 12 and len(used) >= 3  # a seeded choice spread over the set
    first = next(c for c in chats if "caption 0<|im_end|>" in c)
    where = f"{tmp_path / 'c.jsonl'}:1"
    assert f"<|vision_end|>{choose_prompt(DEFAULT_CAPTION_PROMPTS, 0, where)}<|im_end|>" in first
    # A WebDataset caption shard (jpg + txt, with a metadata json), captions as documents (no prompt).
    keys = [(f"k{i}", {"png": png_bytes(56, 56, seed=i), "txt": f"shard caption {i}".encode(),
                       "json": b'{"url": "x", "text": "metadata, not the caption"}'}) for i in range(3)]
    keys.append(("json", {"jpg": png_bytes(56, 56), "json": b'{"caption": "json caption", "url": "y"}'}))
    keys.append(("empty", {"png": png_bytes(56, 56), "txt": b"  "}))
    keys.append(("two", {"0.png": png_bytes(56, 56), "1.png": png_bytes(56, 56), "txt": b"two images"}))
    keys.append(("marker", {"png": png_bytes(56, 56), "txt": b"an <image> tag in the caption"}))
    write_tar(tmp_path / "c.tar", keys)
    loader = _loader(tmp_path, tok, tmp_path / "c.tar", source={"caption_prompts": "none"})
    samples = [s for p in loader for s in _samples(p)]
    docs = sorted(tok.decode(ids.tolist()) for ids, _, _ in samples)
    assert all(d.startswith("<|vision_start|><|image_pad|>") and "<|im_start|>" not in d for d in docs)
    assert [d.split("<|vision_end|>")[1] for d in docs] == [
        "json caption<|endoftext|>", *(f"shard caption {i}<|endoftext|>" for i in range(3))]
    assert loader.report()["skipped"] == {"empty_caption": 1, "image_count_mismatch": 2}


@pytest.mark.parametrize("bad", [{"caption_prompts": "some"}, {"caption_prompts": []},
                                 {"caption_prompts": ["<image>Describe."]}])
def test_caption_prompt_config_errors(bad):
    with pytest.raises(ValueError, match="caption_prompts"):
        DataConfig.from_dict({"sources": [{"path": "x.jsonl", **bad}]})


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_resume_is_exact_with_every_record_kind(tmp_path, tok):
    """Documents, captions (seeded prompts), video chats and image chats mixed: stop, save the state as JSON,
    resume in a new loader with a worker process: the packs equal an uninterrupted run's."""
    import json

    (tmp_path / "a.png").write_bytes(png_bytes(56, 56, seed=3))
    write_test_video(tmp_path / "v.mp4", np.random.default_rng(0).integers(0, 256, (8, 56, 56, 3), np.uint8), fps=4)
    records = []
    for i in range(6):
        records += [{"text": f"Page {i} <image> text {i}", "images": ["a.png"]},
                    {"image": "a.png", "caption": f"caption {i}"},
                    {**qa(f"<video>Q{i}?", f"A{i}."), "videos": ["v.mp4"]},
                    qa(f"<image>R{i}?", f"B{i}.", images=["a.png"]), qa(f"T{i}", f"C{i}.")]
    write_jsonl(tmp_path / "mix.jsonl", records)
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "mix.jsonl")}], "seq_len": 256, "pack_buffer": 4,
                                "num_workers": 1, **PIX, "video": {"min_pixels": 56 * 56, "max_pixels": 56 * 56}})

    def take(loader, n):
        return [p.arrays() for p in itertools.islice(loader, n)]

    reference = take(build_loader(cfg, tok), 24)
    first = build_loader(cfg, tok)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build_loader(cfg, tok)
    resumed.load_state_dict(state)
    tail = take(resumed, 19)
    assert len(reference) == 24 and any(len(p["image_grid_thw"]) and p["image_grid_thw"][:, 0].max() == 2
                                        for p in reference)  # videos are in there
    for a, b in zip(reference, head + tail, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
