"""`mindvl convert --from-hf` of a folder without a tokenizer (issue 43 item 4): it converts (the weights are right)
but says so in one warning line naming the fix, `--tokenizer DIR` copies the model's tokenizer in, and a tokenizer
that does not fit the model (vocabulary) is refused before anything is written."""

from __future__ import annotations

import hf_tiny as H
import pytest

from mindvl.cli import main
from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

pytest.importorskip("transformers")


def test_convert_without_a_tokenizer_warns_in_one_line_and_takes_one(tmp_path, capsys):
    src = tmp_path / "qwen3"
    H.qwen3(src, vocab=load_tokenizer(None).vocab_size)  # weights + config, no tokenizer files
    assert not (src / "tokenizer.json").exists()
    capsys.readouterr()  # transformers' own save progress
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "bare")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mindvl convert: warning:") and "--tokenizer DIR" in err[0]
    assert not (tmp_path / "bare" / "tokenizer.json").exists()

    tok_dir = str(DEFAULT_TOKENIZER_PATH.parent)
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "full"), "--tokenizer", tok_dir]) == 0
    assert "warning" not in capsys.readouterr().err
    assert (tmp_path / "full" / "tokenizer.json").read_bytes() == DEFAULT_TOKENIZER_PATH.read_bytes()


def test_a_tokenizer_that_does_not_fit_is_refused(tmp_path, capsys):
    src = tmp_path / "small-vocab"
    H.qwen3(src)  # a 160-token vocabulary: mindvl's default tokenizer has more
    argv = ["convert", "--from-hf", str(src), "--out", str(tmp_path / "out"), "--tokenizer",
            str(DEFAULT_TOKENIZER_PATH.parent)]
    assert main(argv) == 2
    assert "does not fit" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["convert", "--vision-from", str(src), "--language-from", str(src), "--out", str(tmp_path / "c"),
                 "--tokenizer", str(DEFAULT_TOKENIZER_PATH.parent)]) == 2
