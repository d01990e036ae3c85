"""tools/preprocess_data.py on one file and the tokenizers: jsonl(.gz/.xz) -> megatron indexed
dataset (sharded inputs: tests/test_preprocess_shards.py)."""

import gzip
import importlib.util
import json
import lzma
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.training.tokenizer import (  # noqa: E402
    build_tokenizer,
    padded_vocab_size,
    resolve_tokenizer_model,
)
from tools import preprocess_data  # noqa: E402

CORPUS = os.environ.get("SUBQ_CORPUS") or os.path.join(ROOT, "..", "shared", "data",
                                                       "docs-corpus.jsonl.xz")
HAVE_MISTRAL = importlib.util.find_spec("mistral_common") is not None


def train_tiny_sentencepiece(folder, texts, vocab_size=300) -> str:
    """A small SentencePiece model trained on ``texts`` (the fallback when mistral-common is
    not installed)."""
    import sentencepiece as spm

    prefix = os.path.join(folder, "tiny_sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        num_threads=1, minloglevel=2)
    return prefix + ".model"


def corpus_texts(n):
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(next(f))["text"] for _ in range(n)]


def read_documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    return ds, [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    if HAVE_MISTRAL:
        return "mistral"
    return train_tiny_sentencepiece(str(tmp_path_factory.mktemp("sp")),
                                    [t[:20000] for t in corpus_texts(20)])


def test_malformed_lines_are_counted_and_good_documents_are_exact(tmp_path, tokenizer_model):
    good = ["Hello world.", "def f(x):\n    return  x  # two spaces\n", "Ünïcödé ✓ text"]
    lines = [json.dumps({"text": good[0]}),
             "{not json",
             json.dumps(["a", "list"]),
             json.dumps({"body": "no text key"}),
             json.dumps({"text": 42}),
             json.dumps({"text": ""}),
             "",
             json.dumps({"text": good[1], "source": "x"}),
             json.dumps({"text": good[2]})]
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    flags = ["--input", str(path), "--output-prefix", str(tmp_path / "out"),
             "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
             tokenizer_model, "--workers", "2", "--chunk-size", "1", "--no-progress"]
    # by default the first bad line is an error naming the file and the line; nothing written
    with pytest.raises(SystemExit) as e:
        preprocess_data.main(flags)
    assert str(e.value.code).startswith(f"error: {path}:2: invalid JSON (")
    assert "--skip-bad-lines" in str(e.value.code) and _files(tmp_path) == ["in.jsonl.gz"]
    out = preprocess_data.main(flags + ["--skip-bad-lines"])
    assert out["documents"] == 3
    assert out["empty"] == 1 and out["blank"] == 1  # skipped and counted, never errors
    assert out["malformed"] == {"invalid JSON": 1, "not a JSON object": 1, "no 'text' key": 1,
                                "'text' is not a string": 1}
    assert out["examples"]["no 'text' key"] == [f"{path}:4"]
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model)
    ds, docs = read_documents(str(tmp_path / "out_text_document"))
    expected = [list(tok.tokenize(t)) + [tok.eod] for t in good]
    assert docs == expected  # order kept across workers, EOD appended
    assert out["tokens"]["text"] == sum(map(len, expected))
    assert ds.index.dtype == np.uint16  # smallest dtype for the vocabulary


def test_xz_corpus_slice_several_workers(tmp_path, tokenizer_model, capsys):
    out = preprocess_data.main([
        "--input", CORPUS, "--max-documents", "12", "--output-prefix", str(tmp_path / "docs"),
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", tokenizer_model,
        "--workers", "2", "--no-progress"])
    printed = capsys.readouterr().out
    assert "wrote 12 documents" in printed and "no malformed lines" in printed
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model)
    _, docs = read_documents(out["prefixes"]["text"])
    assert docs == [list(tok.tokenize(t)) + [tok.eod] for t in corpus_texts(12)]


def test_no_eod_and_bad_flags(tmp_path, tokenizer_model):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "one two three"}) + "\n")
    out = preprocess_data.main(["--input", str(path), "--output-prefix", str(tmp_path / "o"),
                                "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                tokenizer_model, "--no-append-eod", "--workers", "1",
                                "--no-progress"])
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model)
    assert read_documents(out["prefixes"]["text"])[1] == [list(tok.tokenize("one two three"))]
    with pytest.raises(SystemExit):
        preprocess_data.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", "x",
                              "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    with pytest.raises(SystemExit):  # a tokenizer type that needs a model
        preprocess_data.main(["--input", str(path), "--output-prefix", "x",
                              "--tokenizer-type", "GPTSentencePieceTokenizer"])


@pytest.mark.skipif(not HAVE_MISTRAL, reason="mistral-common not installed (.ci/run installs it)")
def test_mistral_tokenizer_is_the_packaged_sentencepiece_model():
    path = resolve_tokenizer_model("mistral")
    assert path.endswith(os.path.join("mistral_common", "data", "tokenizer.model.v1"))
    tok = build_tokenizer("GPTSentencePieceTokenizer", "mistral")
    assert tok.vocab_size == 32000 and tok.eod == 2
    assert tok.detokenize(tok.tokenize("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert padded_vocab_size(32000, 128, 2) == 32000
    assert padded_vocab_size(32001, 128, 2) == 32256


def test_huggingface_tokenizers_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.train_from_iterator(["hello world", "hello there", "world peace"] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"text": "hello world"}) + "\n")
    out = preprocess_data.main(["--input", str(path), "--output-prefix", str(tmp_path / "o"),
                                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                str(tmp_path), "--workers", "1", "--no-progress"])
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tok.eod == hf.token_to_id("</s>")
    docs = read_documents(out["prefixes"]["text"])[1]
    assert docs == [hf.encode("hello world", add_special_tokens=False).ids + [tok.eod]]


def test_bad_tokenizer_model_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-model"):
        resolve_tokenizer_model(str(tmp_path / "nope.model"))
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer")


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def test_input_without_documents_fails_and_writes_nothing(tmp_path, tokenizer_model):
    """An input that yields no document (empty, or only blank/malformed/empty-text lines) is an
    error naming it, not a 0-byte dataset that dies later in training ("cannot mmap an empty
    file"); nothing is written, and an earlier run's output is left as it was."""
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "some text"}) + "\n")
    flags = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
             "GPTSentencePieceTokenizer", "--tokenizer-model", tokenizer_model, "--workers", "1",
             "--no-progress"]
    out = preprocess_data.main(["--input", str(good)] + flags)
    prefix = out["prefixes"]["text"]
    before = {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}
    assert _files(tmp_path) == ["good.jsonl", "out_text.blend", "out_text_document.bin",
                                "out_text_document.idx"]
    assert open(tmp_path / "out_text.blend").read().splitlines()[-1] == "out_text_document"

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    junk = tmp_path / "junk.jsonl.gz"
    with gzip.open(junk, "wt", encoding="utf-8") as f:
        f.write("\n".join(["", "{not json", json.dumps({"text": ""}), json.dumps({"body": "x"}),
                           json.dumps([1])]) + "\n")
    for path, counts in ((empty, "0 malformed line(s), 0 blank line(s), 0 empty document(s)"),
                         (junk, "3 malformed line(s), 1 blank line(s), 1 empty document(s)")):
        with pytest.raises(SystemExit) as e:
            preprocess_data.main(["--input", str(path), "--skip-bad-lines"] + flags)
        msg = str(e.value.code)  # a string: the interpreter prints it and exits with status 1
        assert msg.startswith(f"error: --input {path} yielded no documents (") and counts in msg
        assert "nothing was written" in msg
        assert _files(tmp_path) == sorted([good.name, empty.name, junk.name, "out_text.blend",
                                           "out_text_document.bin", "out_text_document.idx"])
        assert before == {ext: open(prefix + ext, "rb").read() for ext in (".bin", ".idx")}

    # several keys: one of them without a single token is refused too
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"text": "body", "title": ""}) + "\n")
    with pytest.raises(SystemExit, match="yielded no tokens under key\\(s\\) 'title'"):
        preprocess_data.main(["--input", str(two), "--json-keys", "text", "title",
                              "--no-append-eod", "--output-prefix", str(tmp_path / "two"),
                              "--tokenizer-type", "GPTSentencePieceTokenizer",
                              "--tokenizer-model", tokenizer_model, "--workers", "1",
                              "--no-progress"])
    assert not [f for f in _files(tmp_path) if f.startswith("two_")]


def test_empty_input_exits_nonzero_as_a_script(tmp_path):
    import subprocess

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(empty), "--output-prefix", str(tmp_path / "o"),
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                           "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"error: --input {empty} yielded no documents" in proc.stderr
    assert _files(tmp_path) == ["empty.jsonl"]
