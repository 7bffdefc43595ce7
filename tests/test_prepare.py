"""`diloco data prepare`: a tokenizer trained here (no downloads) turns text, JSONL and a folder
into the token files learners read, streamed, ids exactly the tokenizer's; a run trains on
them; the mistakes a user makes are refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ops.cli import main

LINES = [f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 11}."
         for i in range(4000)]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=300,
                                                       special_tokens=["[UNK]", "[EOS]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_text_jsonl_and_folder_become_the_tokenizers_ids(tok_file, tmp_path, capsys):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(LINES) + "\n")
    # a small chunk size: the file goes through in many pieces, split at line ends
    from ops.tools.prepare import prepare
    rep = prepare(tok_file, text, tmp_path / "t.bin", batch_bytes=10_000)
    got = np.fromfile(tmp_path / "t.bin", dtype="<u2")
    want = tok.encode("\n".join(LINES) + "\n").ids
    assert rep["tokens"] == got.size > 0 and rep["documents"] == 1 and rep["dtype"] == "u16"
    # the same ids as one encode, but for the pieces' boundaries (each a line's end)
    assert abs(got.size - len(want)) <= got.size // 100 and got.max() < rep["vocab_size"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join([json.dumps({"text": t}) for t in LINES[:50]]
                               + ["not json", json.dumps({"other": 1})]) + "\n")
    eos = tok.token_to_id("[EOS]")
    assert main(["data", "prepare", "--tokenizer", str(tok_file), "--input", str(jsonl),
                 "--out", str(tmp_path / "j.u16"), "--eos", str(eos), "--json", "--quiet"]) == 0
    rep = json.loads(capsys.readouterr().out)
    ids = np.fromfile(tmp_path / "j.u16", dtype="<u2").tolist()
    want = [i for k, t in enumerate(LINES[:50]) for i in ([eos] if k else []) + tok.encode(t).ids]
    assert ids == want and rep["documents"] == 50 and rep["largest_id"] == max(want)
    folder = tmp_path / "texts"
    folder.mkdir()
    for k in range(3):
        (folder / f"{k}.txt").write_text(LINES[k])
    assert main(["data", "prepare", "--tokenizer", str(tok_file), "--input", str(folder),
                 "--out", str(tmp_path / "f.u32"), "--quiet"]) == 0
    assert np.fromfile(tmp_path / "f.u32", dtype="<u4").tolist() == [
        i for t in LINES[:3] for i in tok.encode(t).ids]


def test_mistakes_are_refused_in_one_line(tok_file, tmp_path, capsys):
    text = tmp_path / "c.txt"
    text.write_text("hello")
    for args, said in (
            (["--input", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "a.bin")],
             "no such file"),
            (["--input", str(text), "--out", str(tmp_path / "a.npy")], "name it .bin"),
            (["--input", str(text), "--out", str(tmp_path / "a.bin"), "--eos", "300"],
             "--eos 300"),
            (["--input", str(text), "--out", str(tmp_path / "a.bin"), "--tokenizer",
              str(text)], "not a tokenizers JSON file")):
        argv = ["data", "prepare", "--tokenizer", str(tok_file), *args, "--quiet"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
    assert not list(tmp_path.glob(".a.*"))  # no temporary file left behind


def test_a_run_trains_on_prepared_tokens_and_an_id_past_the_vocabulary_is_refused(
        tok_file, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(LINES))
    assert main(["data", "prepare", "--tokenizer", str(tok_file), "--input", str(text),
                 "--out", str(tmp_path / "t.bin"), "--quiet"]) == 0
    args = [sys.executable, "-m", "ops.cli", "run", "--engine=inprocess", "--json",
            "--out", str(tmp_path / "runs"), "--set", f"data.source={tmp_path / 't.bin'}",
            "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
            "--set", "model.seq_len=32", "--set", "inner.batch_size=8", "--set", "learners=2",
            "--set", "steps=60", "--set", "sync.sync_every=10", "--set", "sync.fragments=2"]
    out = subprocess.run([*args, "--set", "model.vocab_size=300"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5, s
    # the same tokens with the byte model's vocabulary (256): refused, naming both numbers
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "model.vocab_size" in out.stderr, out.stderr[-2000:]
