"""tools/preprocess_data.py on sharded input (a folder / glob of .jsonl, .jsonl.gz, .jsonl.xz,
.jsonl.zst): equal to the single-file output, resumable after a SIGKILL without redoing a finished
shard, corrupt lines named by file:line, and the blend file read by the trainer's
--data-args-path / --per-split-data-args-path."""

import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from test_preprocess import CORPUS, read_documents, tokenizer_model  # noqa: E402,F401
from tools import preprocess_data  # noqa: E402

# natural path order (part-2 before part-10, sub/ after part-*) is the documents' order;
# mixed compressions
SHARDS = ["part-0.jsonl", "part-1.jsonl.gz", "part-2.jsonl.zst", "part-9.jsonl.xz",
          "part-10.jsonl", "sub/part-11.jsonl.zst"]
PER_SHARD = 4


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    elif path.endswith(".xz"):
        with lzma.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    elif path.endswith(".zst"):
        import zstandard

        with open(path, "wb") as f:  # two frames: the reader must not stop after the first
            half = len(text) // 2
            for part in (text[:half], text[half:]):
                f.write(zstandard.ZstdCompressor().compress(part.encode("utf-8")))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer_model):  # noqa: F811
    """The corpus' first documents as one file and as shards, and the single-file output."""
    work = tmp_path_factory.mktemp("shards")
    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        # short documents keep the tokenization cheap
        lines = [line for line in (next(f) for _ in range(200))
                 if len(json.loads(line)["text"]) < 6000][:len(SHARDS) * PER_SHARD]
    (work / "all.jsonl").write_text("".join(lines))
    for i, name in enumerate(SHARDS):
        _write(str(work / "in" / name), "".join(lines[i * PER_SHARD:(i + 1) * PER_SHARD]))
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
             tokenizer_model, "--no-progress"]
    out = preprocess_data.main(["--input", str(work / "all.jsonl"), "--output-prefix",
                                str(work / "single"), "--workers", "1"] + flags)
    _, docs = read_documents(out["prefixes"]["text"])
    assert len(docs) == len(SHARDS) * PER_SHARD
    return {"work": work, "flags": flags, "docs": docs, "shards": str(work / "in")}


def _docs(prefixes):
    return [d for p in prefixes for d in read_documents(p)[1]]


def test_sharded_output_equals_single_file_output(corpus, tmp_path):
    out = preprocess_data.main(["--input", corpus["shards"], "--output-prefix",
                                str(tmp_path / "sp"), "--workers", "2", "--merge-into", "2"]
                               + corpus["flags"])
    assert out["datasets"]["text"] == [str(tmp_path / "sp_00_text_document"),
                                       str(tmp_path / "sp_01_text_document")]
    assert _docs(out["datasets"]["text"]) == corpus["docs"]  # same documents, same order
    # the blend file: weights = token counts, prefixes relative to its folder
    blend = open(out["blends"]["text"]).read().splitlines()
    sizes = [sum(map(len, read_documents(p)[1])) for p in out["datasets"]["text"]]
    assert [line for line in blend if not line.startswith("#")] == [
        f"{sizes[0]} sp_00_text_document", f"{sizes[1]} sp_01_text_document"]
    assert sorted(os.listdir(tmp_path / "sp_shards")) == ["lock", "manifest.json"]  # merged
    # shell-expanded file list in another order, and a quoted glob: the same documents
    files = [os.path.join(corpus["shards"], s) for s in SHARDS][::-1]
    out = preprocess_data.main(["--input"] + files + ["--output-prefix", str(tmp_path / "list"),
                                                      "--workers", "1"] + corpus["flags"])
    assert _docs(out["datasets"]["text"]) == corpus["docs"]
    out2 = preprocess_data.main(["--input", corpus["shards"] + "/**/*.jsonl*", "--output-prefix",
                                 str(tmp_path / "list"), "--workers", "1"] + corpus["flags"])
    assert _docs(out2["datasets"]["text"]) == corpus["docs"]


def _stat(path):
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def test_killed_run_resumes_without_redoing_a_finished_shard(corpus, tmp_path, capsys):
    import psutil

    prefix = str(tmp_path / "k")
    work = prefix + "_shards"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
           corpus["shards"], "--output-prefix", prefix, "--workers", "2", "--keep-shards"] \
        + corpus["flags"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # every shard task sleeps 1.5 s first: after the first shard's record appears, the next ones
    # are at least 1.5 s away from theirs
    proc = subprocess.Popen(cmd, env=dict(env, SUBQ_PREPROCESS_SHARD_DELAY_S="1.5"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def records():
        names = os.listdir(work) if os.path.isdir(work) else []
        return sorted(n for n in names if n.endswith(".json") and n != "manifest.json")

    deadline = time.time() + 240
    while not records():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "no shard finished"
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)  # the main process only: its pool workers must die too
    proc.wait()
    log1 = proc.stdout.read()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, f"pool workers outlived the killed run: {alive}"
    done = records()
    assert 1 <= len(done) < len(SHARDS), (done, log1)
    assert not any(n.endswith((".bin", ".idx")) for n in os.listdir(os.path.dirname(prefix))
                   if n.startswith("k_text")), "no final output before every shard is done"
    finished = {n: [_stat(os.path.join(work, f)) for f in (n, n[:-5] + "_text_document.bin",
                                                            n[:-5] + "_text_document.idx")]
                for n in done}

    # the same command again (in this process: a second interpreter start costs seconds)
    capsys.readouterr()
    preprocess_data.main(cmd[2:])
    log = capsys.readouterr().out
    assert f"resuming: {len(done)} of {len(SHARDS)} shards already done" in log, log
    for n in done:
        path = json.load(open(os.path.join(work, n)))["path"]
        assert path in log.split("resuming:")[1].splitlines()[0]  # named as skipped
        assert f"done: {path} " not in log  # and not done again
    assert log.count("done: ") == len(SHARDS) - len(done)
    assert {n: [_stat(os.path.join(work, f)) for f in (n, n[:-5] + "_text_document.bin",
                                                        n[:-5] + "_text_document.idx")]
            for n in done} == finished  # the finished shards' files were not rewritten
    assert _docs([prefix + "_text_document"]) == corpus["docs"]  # as an uninterrupted run


def test_corrupt_line_names_file_and_line_or_is_skipped_and_counted(corpus, tmp_path):
    folder = tmp_path / "in"
    good = [json.dumps({"text": "first good document"}), json.dumps({"text": "second one"})]
    _write(str(folder / "a.jsonl"), "\n".join(good) + "\n")
    bad = [good[0], "", '{"text": "unterminated', json.dumps(["a", "list"]),
           json.dumps({"body": "no text key"}), json.dumps({"text": 7}), good[1]]
    _write(str(folder / "b.jsonl.zst"), "\n".join(bad) + "\n")
    prefix = str(tmp_path / "c")
    argv = ["--input", str(folder), "--output-prefix", prefix, "--workers", "1"] \
        + corpus["flags"]
    with pytest.raises(SystemExit) as e:
        preprocess_data.main(argv)
    msg = str(e.value.code)
    assert msg.startswith(f"error: {folder / 'b.jsonl.zst'}:3: invalid JSON (")
    assert "--skip-bad-lines" in msg and "nothing final was written" in msg
    names = os.listdir(tmp_path)
    assert not [n for n in names if n.startswith("c_text")]  # no dataset, no blend file
    assert not [n for n in os.listdir(prefix + "_shards") if "b-" in n]  # b's partial output
    assert [n for n in os.listdir(prefix + "_shards") if n.startswith("a-") and
            n.endswith(".json")]  # a is finished and kept for the resumed run

    # a changed meaning is refused on resume, naming the flag
    for extra, flag in ((["--no-append-eod"], "--append-eod/--no-append-eod"),
                        (["--json-keys", "text", "title"], "--json-keys")):
        with pytest.raises(SystemExit, match=flag):
            preprocess_data.main(argv + extra)
    with pytest.raises(SystemExit, match="--tokenizer-type: this run has 'NullTokenizer'"):
        preprocess_data.main(argv[:6] + ["--tokenizer-type", "NullTokenizer", "--vocab-size",
                                         "300", "--no-progress"])

    out = preprocess_data.main(argv + ["--skip-bad-lines"])
    assert out["documents"] == 4 and out["blank"] == 1
    assert out["malformed"] == {"invalid JSON": 1, "not a JSON object": 1, "no 'text' key": 1,
                                "'text' is not a string": 1}
    where = str(folder / "b.jsonl.zst")
    assert out["examples"] == {"invalid JSON": [f"{where}:3"],
                               "not a JSON object": [f"{where}:4"],
                               "no 'text' key": [f"{where}:5"],
                               "'text' is not a string": [f"{where}:6"]}


def test_bad_flags_name_the_flag(corpus, tmp_path, capsys):
    def error(argv):
        with pytest.raises(SystemExit):
            preprocess_data.main(argv + ["--output-prefix", str(tmp_path / "o")]
                                 + corpus["flags"])
        return capsys.readouterr().err

    shards, single = corpus["shards"], str(corpus["work"] / "all.jsonl")
    assert "--merge-into=0 must be >= 1" in error(["--input", shards, "--merge-into", "0"])
    assert "--merge-into=7 exceeds the 6 input shard(s)" in error(
        ["--input", shards, "--merge-into", "7"])
    assert "--merge-into=2 needs a sharded --input" in error(
        ["--input", single, "--merge-into", "2"])
    assert "--max-documents takes a slice of a single-file --input" in error(
        ["--input", shards, "--max-documents", "3"])
    assert f"--input {tmp_path}/*.jsonl: the pattern matches no" in error(
        ["--input", f"{tmp_path}/*.jsonl"])
    (tmp_path / "empty").mkdir()
    assert f"--input {tmp_path / 'empty'}: the folder holds no" in error(
        ["--input", str(tmp_path / "empty")])
    assert "--workers=0 must be >= 1" in error(["--input", shards, "--workers", "0"])
    assert not os.path.exists(tmp_path / "o_shards")  # refused before anything is written


# ------------------------------------------------------------------------------------------------
# the trainer reads the blend file
# ------------------------------------------------------------------------------------------------
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--lr", "1e-3", "--split", "90,10,0", "--num-workers", "0", "--eval-iters", "1",
        "--eval-interval", "100", "--log-interval", "1", "--seed", "1", "--train-iters", "2"]


def _parse(argv, capsys=None):
    from megatron_subq.training import arguments

    if capsys is None:
        return arguments.parse_args(argv, world_size=1)
    with pytest.raises(SystemExit) as e:
        arguments.parse_args(argv, world_size=1)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def _train(argv):
    from megatron_subq.training import pretrain

    return pretrain(argv)


def test_blend_file_drives_the_trainer(corpus, tmp_path, capsys):
    from megatron_subq.testing import run_distributed

    data = tmp_path / "data"
    out = preprocess_data.main(["--input", corpus["shards"], "--output-prefix", str(data / "sp"),
                                "--workers", "1", "--merge-into", "2"] + corpus["flags"])
    blend = out["blends"]["text"]
    tok = corpus["flags"][:4]
    # relative prefixes resolve against the file's folder, not the working directory
    args = _parse(TINY + tok + ["--data-args-path", blend])
    assert args.data_path[1::2] == [str(data / "sp_00_text_document"),
                                    str(data / "sp_01_text_document")]
    assert [float(w) for w in args.data_path[::2]] == [
        float(line.split()[0]) for line in open(blend) if not line.startswith("#")]
    # per-split JSON
    split = tmp_path / "split.json"
    split.write_text(json.dumps({"train": ["data/sp_00_text_document"],
                                 "valid": "data/sp_01_text_document"}))
    args = _parse(TINY + tok + ["--per-split-data-args-path", str(split)])
    assert args.train_data_path == [str(data / "sp_00_text_document")]
    assert args.valid_data_path == [str(data / "sp_01_text_document")]
    assert args.test_data_path is None

    # errors name the flag
    missing = tmp_path / "missing.blend"
    missing.write_text("# a comment\n0.5 data/sp_00_text_document\n0.5 data/nope\n")
    err = _parse(TINY + tok + ["--data-args-path", str(missing)], capsys)
    assert f"--data-args-path {missing}: the prefix 'data/nope' (relative prefixes are " \
           f"relative to the file's folder: {tmp_path / 'data' / 'nope'}) has no" in err
    err = _parse(TINY + tok + ["--data-args-path", blend, "--data-path", "x"], capsys)
    assert "--data-args-path conflicts with --data-path" in err
    err = _parse(TINY + tok + ["--data-args-path", blend, "--per-split-data-args-path",
                               str(split)], capsys)
    assert "--data-args-path conflicts with --per-split-data-args-path" in err
    (tmp_path / "bad.json").write_text(json.dumps({"valid": ["x"]}))
    err = _parse(TINY + tok + ["--per-split-data-args-path", str(tmp_path / "bad.json")], capsys)
    assert "train (required)" in err
    (tmp_path / "empty.blend").write_text("# nothing\n")
    err = _parse(TINY + tok + ["--data-args-path", str(tmp_path / "empty.blend")], capsys)
    assert "lists no dataset" in err

    # a real run: two iterations on the blend's datasets
    [summary] = run_distributed(_train, world_size=1, args=(
        TINY + tok + ["--data-args-path", blend],))
    import math

    assert sorted(summary["iterations"]) == [1, 2]
    assert all(math.isfinite(v) for v in summary["iterations"].values())
