"""`mindvl chat` says why an answer is empty: an end token as the first token, or tokens that decode to nothing
(special tokens, whitespace) with the end token or the max_new_tokens limit that stopped them."""

from __future__ import annotations

import importlib

import pytest
from tiny_mindvl import tiny_model_folder

from mindvl.cli import main as cli_main
from mindvl.infer import load_for_chat
from mindvl.infer.chat import ChatSession

chat_module = importlib.import_module("mindvl.infer.chat")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("chat") / "m", 1)


def scripted(monkeypatch, ids):
    """The model "generates" exactly `ids` (the real generate's output layout: the end token included)."""
    monkeypatch.setattr(chat_module, "generate", lambda model, prompts, **kw: [list(ids) for _ in prompts])


def test_why_empty(folder, monkeypatch):
    model, tok = load_for_chat(folder, device="cpu")
    session = ChatSession(model, tok, system=None, max_new_tokens=4)
    sp = tok.special

    scripted(monkeypatch, [sp.im_end])
    answer = session.ask("hi")
    assert answer == ""
    assert session.why_empty(answer) == ("empty answer: the model ended its turn with <|im_end|> as its first "
                                         "token (0 tokens generated)")

    space = tok.encode(" ")
    scripted(monkeypatch, [sp.vision_start, *space, sp.endoftext])
    answer = session.ask("hi")
    why = session.why_empty(answer)
    assert why.startswith(f"empty answer: the model generated {1 + len(space)} tokens that decode to nothing "
                          "visible ('<|vision_start|> ")
    assert why.endswith("and ended its turn with <|endoftext|>")

    scripted(monkeypatch, [sp.vision_start] * 4)  # max_new_tokens reached, no end token
    why = session.why_empty(session.ask("hi"))
    assert why.endswith("hit --max-new-tokens 4 without an end token") and "generated 4 tokens" in why

    scripted(monkeypatch, [*tok.encode("42"), sp.im_end])
    answer = session.ask("hi")
    assert answer == "42" and session.why_empty(answer) is None


def test_chat_cli_prints_the_reason_on_stderr(folder, monkeypatch, capsys):
    _, tok = load_for_chat(folder, device="cpu")
    scripted(monkeypatch, [tok.special.im_end])
    assert cli_main(["chat", str(folder), "--prompt", "hi", "--no-system", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n"  # the (empty) answer itself stays on stdout, alone
    assert "(empty answer: the model ended its turn with <|im_end|> as its first token" in captured.err
