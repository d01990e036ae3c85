"""Start-up checks of the trainer's data flags (megatron_subq/training/data.py: check_data):
a missing .bin/.idx, a .bin whose size is not what its .idx implies, and splits that megatron-core's
GPTDataset cannot build (it loops forever on a split of 0 tokens). Every check runs in
arguments.parse_args, before anything is built, so none of these tests can hang."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.training import arguments  # noqa: E402
from megatron_subq.training.data import check_indexed_dataset, check_splits  # noqa: E402


def write_indexed_dataset(prefix, lengths, dtype=np.uint16) -> str:
    """A megatron indexed dataset PREFIX.bin/.idx of documents with the given token counts,
    written by megatron's own IndexedDatasetBuilder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i, n in enumerate(lengths):
        builder.add_document(np.arange(n, dtype=dtype) % 50 + i % 7, [n])
    builder.finalize(prefix + ".idx")
    return prefix


# 32-token sequences, 3 iterations of 4 samples, 2 eval iterations of 4 samples
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--eval-iters", "2", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        arguments.parse_args(argv, world_size=1)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())  # argparse wraps nothing, but be safe


# ---- item 4: prefixes that do not exist -------------------------------------------------------
def test_missing_prefix_fails_at_argument_time_naming_the_flag(tmp_path, capsys):
    good = write_indexed_dataset(tmp_path / "good", [100] * 40)
    missing = str(tmp_path / "nope")
    err = _error(BASE + ["--data-path", missing], capsys)
    assert f"--data-path {missing}: no {missing}.bin/.idx" in err
    # a blend of weighted prefixes: the missing one is named, weights are not taken for paths
    err = _error(BASE + ["--data-path", "0.3", good, "0.7", missing], capsys)
    assert f"--data-path {missing}: no {missing}.bin/.idx" in err
    # per-split flags
    for flag in ("--train-data-path", "--valid-data-path", "--test-data-path"):
        paths = {f: good for f in ("--train-data-path", "--valid-data-path", "--test-data-path")}
        paths[flag] = missing
        err = _error(BASE + [t for f, p in paths.items() for t in (f, p)], capsys)
        assert f"{flag} {missing}: no {missing}.bin/.idx" in err
    # only one of the pair
    os.remove(good + ".bin")
    assert f"--data-path {good}: no {good}.bin;" in _error(BASE + ["--data-path", good], capsys)
    # the prefix given without tools/preprocess_data.py's suffix gets a hint
    write_indexed_dataset(tmp_path / "docs_text_document", [100] * 40)
    err = _error(BASE + ["--data-path", str(tmp_path / "docs")], capsys)
    assert f"(did you mean {tmp_path / 'docs_text_document'}?)" in err


def test_existing_data_and_mock_data_still_parse(tmp_path):
    good = write_indexed_dataset(tmp_path / "good", [100] * 40)
    other = write_indexed_dataset(tmp_path / "other", [80] * 40)
    args = arguments.parse_args(BASE + ["--data-path", good, "--split", "90,10,0"], world_size=1)
    assert args.data_path == [good]
    arguments.parse_args(BASE + ["--data-path", "0.5", good, "0.5", other, "--split", "90,10,0"],
                         world_size=1)
    arguments.parse_args(BASE + ["--train-data-path", good, "--valid-data-path", other],
                         world_size=1)
    arguments.parse_args(BASE + ["--mock-data"], world_size=1)


# ---- item 3: .bin / .idx consistency ----------------------------------------------------------
def test_truncated_or_overlong_bin_is_refused_naming_both_sizes(tmp_path, capsys):
    prefix = write_indexed_dataset(tmp_path / "d", [100] * 40)
    expected = 40 * 100 * 2  # uint16 tokens
    assert os.path.getsize(prefix + ".bin") == expected
    check_indexed_dataset(prefix)  # intact: passes
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(expected - 10)
    with pytest.raises(ValueError) as e:
        check_indexed_dataset(prefix, "--train-data-path")
    msg = str(e.value)
    assert msg.startswith(f"--train-data-path {prefix}: {prefix}.bin is {expected - 10:,} bytes "
                          f"but {prefix}.idx implies {expected:,}")
    assert "truncated" in msg
    # through the trainer's flags
    err = _error(BASE + ["--data-path", prefix, "--split", "90,10,0"], capsys)
    assert f"{prefix}.bin is {expected - 10:,} bytes but {prefix}.idx implies {expected:,}" in err
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\0" * 12)
    with pytest.raises(ValueError, match="longer than indexed"):
        check_indexed_dataset(prefix)


def test_bad_or_empty_index_is_refused(tmp_path):
    prefix = write_indexed_dataset(tmp_path / "d", [10, 10])
    with open(prefix + ".idx", "wb") as f:
        f.write(b"not an index at all")
    with pytest.raises(ValueError, match=f"{prefix}.idx is not a readable megatron index"):
        check_indexed_dataset(prefix)
    empty = write_indexed_dataset(tmp_path / "empty", [])  # 0-byte .bin: megatron cannot mmap it
    with pytest.raises(ValueError, match="the dataset holds no tokens"):
        check_indexed_dataset(empty, "--data-path")


# ---- item 2: splits megatron cannot build -----------------------------------------------------
def test_split_without_documents_is_refused_not_built(tmp_path, capsys):
    """100 documents at the default --split 969,30,1: the test split gets round(0.999 * 100) ..
    100 = no document, on which megatron's GPTDataset._get_num_epochs loops forever."""
    prefix = write_indexed_dataset(tmp_path / "small", [100] * 100)
    err = _error(BASE + ["--data-path", prefix], capsys)
    assert f"--split 969,30,1: the test split of --data-path {prefix} holds 0 documents / " \
           "0 tokens" in err
    assert "would loop forever" in err
    assert "The run asks 8 samples of it" in err  # --eval-iters 2 x --global-batch-size 4
    assert "train 97 documents / 9,700 tokens; valid 3 documents / 300 tokens; test 0 " \
        "documents / 0 tokens" in err
    # even a split asked for 0 samples hangs megatron (it wants n * seq + 1 tokens)
    err = _error(BASE[:-8] + ["--eval-iters", "0", "--lr", "1e-3", "--tokenizer-type",
                              "NullTokenizer", "--vocab-size", "128", "--data-path", prefix],
                 capsys)
    assert "the test split" in err and "loop forever" in err and "asks 0 samples" in err


def test_split_shorter_than_one_sample_is_refused(tmp_path, capsys):
    # 100 documents of 3 tokens, --split 90,10,0: valid has 10 x 3 = 30 tokens < 33 = seq + 1
    prefix = write_indexed_dataset(tmp_path / "short", [3] * 100)
    err = _error(BASE + ["--data-path", prefix, "--split", "90,10,0"], capsys)
    assert f"the valid split of --data-path {prefix} holds 10 documents / 30 tokens, less than " \
           "one sample of --seq-length 32 (33 tokens)" in err
    # the boundary: 11 documents of 3 tokens = 33 tokens is one sample, and passes
    prefix = write_indexed_dataset(tmp_path / "edge", [3] * 110)
    arguments.parse_args(BASE + ["--data-path", prefix, "--split", "90,10,0"], world_size=1)


def test_blends_are_checked_per_dataset(tmp_path, capsys):
    big = write_indexed_dataset(tmp_path / "big", [100] * 1000)
    small = write_indexed_dataset(tmp_path / "small", [100] * 100)
    # weighted: megatron asks every dataset of the blend for its share, even at weight 0
    err = _error(BASE + ["--data-path", "1", big, "0", small], capsys)
    assert f"the test split of --data-path {small} holds 0 documents" in err
    # per-split paths: an empty valid dataset
    empty = write_indexed_dataset(tmp_path / "tiny", [20])
    err = _error(BASE + ["--train-data-path", big, "--valid-data-path", empty], capsys)
    assert f"--valid-data-path {empty} holds 1 documents / 20 tokens, less than one sample" in err
    # unweighted blend: read once, not repeated; 2 x 1 samples < 12 training samples
    a = write_indexed_dataset(tmp_path / "a", [40])
    b = write_indexed_dataset(tmp_path / "b", [40])
    err = _error(BASE + ["--train-data-path", a, b], capsys)
    assert "--train-data-path (an unweighted blend of 2 datasets, read once without repeats) " \
           "provides 2 samples of --seq-length 32; the run needs 12" in err
    # the same blend weighted is repeated by megatron, and passes
    arguments.parse_args(BASE + ["--train-data-path", "1", a, "1", b], world_size=1)


def test_bad_split_names_the_flag(tmp_path, capsys):
    prefix = write_indexed_dataset(tmp_path / "d", [100] * 1000)
    for bad in ("0,0,0", "90,10,0,1", "a,b", "1.2.3"):
        assert f"--split {bad} is invalid" in _error(BASE + ["--data-path", prefix, "--split",
                                                             bad], capsys)


def test_accepted_boundary_splits_build_in_megatron(tmp_path):
    """What check_splits lets through at its boundary (every split exactly one sample's tokens)
    is built by megatron-core's builder, with the samples the run asks for."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from megatron_subq.training.tokenizer import build_tokenizer

    prefix = write_indexed_dataset(tmp_path / "edge", [3] * 110)  # valid: 33 tokens
    args = arguments.parse_args(BASE + ["--data-path", prefix, "--split", "90,10,0"],
                                world_size=1)
    check_splits(args)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=32, blend=([prefix], None), split="90,10,0",
        path_to_cache=str(tmp_path / "cache"), tokenizer=build_tokenizer("NullTokenizer",
                                                                         vocab_size=128),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [12, 8, 8], lambda: True,
                                                       config).build()
    assert len(train) >= 12 and len(valid) >= 8 and test is None
