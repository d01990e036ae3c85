"""Loss-mask sidecar datasets (``--subq-loss-mask-data``, megatron_subq/training/loss_mask_data.py):
the sidecar's mask lines up with the labels of samples that cut documents anywhere (shuffled),
composes with ``--eod-mask-loss``, leaves prefixes without a sidecar alone in a blend, is refused
at start-up when bad, and changes what a tiny trainer run learns (an all-zero mask trains to a
loss of 0 without NaN)."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.training import arguments  # noqa: E402

EOD = 128  # NullTokenizer --vocab-size 128: EOD is 128
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "10", "--eval-iters", "0", "--lr", "1e-3", "--split", "100,0,0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-workers", "0"]


def write_documents(prefix, documents, dtype=np.uint16) -> str:
    """PREFIX.bin/.idx holding ``documents`` (arrays of token ids), via megatron's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def random_documents(n, low, high, seed, min_len=3, max_len=40):
    """``n`` documents of ids in [low, high), each ending with EOD, of varied lengths."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(low, high, rng.integers(min_len, max_len)), EOD)
            for _ in range(n)]


def write_sidecar(prefix, documents, value=lambda tokens: tokens % 2 == 0,
                  dtype=np.uint8) -> str:
    """PREFIX_lossmask: ``value(tokens)`` per token of each document."""
    return write_documents(str(prefix) + "_lossmask",
                           [np.asarray(value(np.asarray(d)), dtype=dtype) for d in documents],
                           dtype=dtype)


def build(argv):
    from megatron_subq.training.data import build_datasets
    from megatron_subq.training.tokenizer import build_tokenizer

    args = arguments.parse_args(BASE + argv, world_size=1)
    return build_datasets(args, build_tokenizer("NullTokenizer", vocab_size=128))[0]


def _error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        arguments.parse_args(BASE + argv, world_size=1)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


# ---- alignment --------------------------------------------------------------------------------
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_mask_follows_the_labels_across_document_boundaries(tmp_path, eod_mask_loss):
    """Documents of 4..40 tokens cut into shuffled 16-token samples over several epochs: the
    loss mask at i is the sidecar's value of labels[i] (1 iff even; EOD = 128 is even), times
    megatron's own mask (--eod-mask-loss: 0 where the input token is EOD)."""
    docs = random_documents(30, 0, 100, seed=1)
    prefix = write_documents(tmp_path / "niah", docs)
    write_sidecar(prefix, docs)
    extra = ["--eod-mask-loss"] if eod_mask_loss else []
    train = build(["--data-path", prefix, "--subq-loss-mask-data", "--data-cache-path",
                   str(tmp_path / "cache")] + extra)
    assert type(train).__name__ == "LossMaskGPTDataset" and train.loss_mask_dataset is not None
    assert len(train) >= 40 and train.shuffle_index[:8].tolist() != list(range(8))  # shuffled
    inner_eods = 0
    for i in range(len(train)):
        item = train[i]
        tokens, labels, mask = item["tokens"], item["labels"], item["loss_mask"]
        expected = (labels % 2 == 0).float()
        if eod_mask_loss:
            expected = expected * (tokens != EOD).float()
        assert torch.equal(mask, expected), i
        inner_eods += int((tokens[1:] == EOD).sum())
    assert inner_eods > 20  # samples do span document boundaries
    # the same tokens as plain GPTDataset (same indices): only the mask differs
    plain = build(["--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")] + extra)
    assert type(plain).__name__ == "GPTDataset"
    for i in range(8):
        assert torch.equal(plain[i]["tokens"], train[i]["tokens"])
        assert torch.equal(plain[i]["labels"], train[i]["labels"])
        assert torch.equal(plain[i]["loss_mask"] * (train[i]["labels"] % 2 == 0).float(),
                           train[i]["loss_mask"])


def test_mask_without_the_extra_token(tmp_path):
    """add_extra_token_to_sequence=False: labels are the tokens rolled by one (pad last); the
    sidecar mask rolls with them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron_subq.training.loss_mask_data import LossMaskGPTDataset
    from megatron_subq.training.tokenizer import build_tokenizer

    docs = random_documents(30, 0, 100, seed=2)
    prefix = write_documents(tmp_path / "niah", docs)
    write_sidecar(prefix, docs)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=16, blend=([prefix], None), split="100,0,0",
        path_to_cache=str(tmp_path / "cache"), add_extra_token_to_sequence=False,
        tokenizer=build_tokenizer("NullTokenizer", vocab_size=128), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    train = BlendedMegatronDatasetBuilder(LossMaskGPTDataset, [20, 0, 0], lambda: True,
                                         config).build()[0]
    for i in range(len(train)):
        item = train[i]
        expected = (item["labels"] % 2 == 0).float()
        expected[-1] = 0.0  # the last label is the pad
        assert torch.equal(item["loss_mask"], expected), i


def test_blend_keeps_the_plain_mask_for_a_prefix_without_sidecar(tmp_path):
    """'0.5 NIAH 0.5 TEXT', only NIAH (ids < 50) with a sidecar: TEXT samples (ids >= 50) keep
    megatron's all-ones mask; NIAH samples get the sidecar's. Without the flag both are plain."""
    niah_docs = random_documents(40, 0, 50, seed=3)
    text_docs = random_documents(40, 50, 100, seed=4)
    niah = write_documents(tmp_path / "niah", niah_docs)
    write_sidecar(niah, niah_docs)
    text = write_documents(tmp_path / "text", text_docs)
    # no --data-cache-path: with one, megatron's BlendedDataset asks torch.distributed (no group
    # here) for the rank
    blend = ["--data-path", "0.5", niah, "0.5", text]
    seen = {"niah": 0, "text": 0}
    for flag in (True, False):
        train = build(blend + (["--subq-loss-mask-data"] if flag else []))
        for i in range(len(train)):
            item = train[i]
            content = item["tokens"][item["tokens"] != EOD]
            source = "niah" if bool((content < 50).all()) else "text"
            assert source == "niah" or bool((content >= 50).all())
            if flag and source == "niah":
                expected = (item["labels"] % 2 == 0).float()
            else:
                expected = torch.ones(16)
            assert torch.equal(item["loss_mask"], expected), (flag, source, i)
            seen[source] += 1
    assert seen["niah"] > 10 and seen["text"] > 10


# ---- start-up errors ---------------------------------------------------------------------------
def test_bad_sidecars_are_refused_before_anything_is_built(tmp_path, capsys):
    docs = random_documents(40, 0, 100, seed=5)
    a = write_documents(tmp_path / "a", docs)
    b = write_documents(tmp_path / "b", docs)
    # no prefix has a sidecar: the flag and every place looked at are named
    err = _error(["--data-path", a, b, "--subq-loss-mask-data"], capsys)
    assert "--subq-loss-mask-data is set but no data prefix has a loss-mask sidecar" in err
    assert f"{a}_lossmask.bin/.idx" in err and f"{b}_lossmask.bin/.idx" in err
    # the same through per-split flags
    err = _error(["--train-data-path", a, "--subq-loss-mask-data"], capsys)
    assert f"looked for {a}_lossmask.bin/.idx" in err
    # mock data
    err = _error(["--mock-data", "--subq-loss-mask-data"], capsys)
    assert "--subq-loss-mask-data conflicts with --mock-data" in err
    # one document too few
    write_sidecar(a, docs[:-1])
    err = _error(["--data-path", a, "--subq-loss-mask-data"], capsys)
    assert (f"--subq-loss-mask-data: the loss-mask sidecar {a}_lossmask does not match its data "
            f"prefix {a}: 39 vs 40 documents; the first differing is document 39 (absent in the "
            f"sidecar, {len(docs[39])} tokens in the data)") in err
    # document 7 one token longer
    longer = list(docs)
    longer[7] = np.append(docs[7], 2)
    write_sidecar(a, longer)
    err = _error(["--data-path", a, "--subq-loss-mask-data"], capsys)
    assert (f"40 vs 40 documents; the first differing is document 7 ({len(docs[7]) + 1} tokens "
            f"in the sidecar, {len(docs[7])} tokens in the data)") in err
    assert f"sidecar {a}_lossmask" in err and f"prefix {a}:" in err
    # uint16 sidecar
    write_sidecar(a, docs, dtype=np.uint16)
    err = _error(["--data-path", a, "--subq-loss-mask-data"], capsys)
    assert f"the loss-mask sidecar {a}_lossmask of {a} has dtype uint16; sidecars are uint8" in err
    # values other than 0/1
    write_sidecar(a, docs, value=lambda t: t % 3)
    err = _error(["--data-path", a, "--subq-loss-mask-data"], capsys)
    assert f"the loss-mask sidecar {a}_lossmask of {a} holds the value 2" in err
    # half a sidecar
    write_sidecar(a, docs)
    os.remove(a + "_lossmask.bin")
    err = _error(["--data-path", a, "--subq-loss-mask-data"], capsys)
    assert f"the loss-mask sidecar of {a} is incomplete: no {a}_lossmask.bin" in err
    # good sidecar: parses; off: a bad sidecar is ignored
    write_sidecar(a, docs)
    assert arguments.parse_args(BASE + ["--data-path", a, b, "--subq-loss-mask-data"],
                                world_size=1).subq_loss_mask_data
    write_sidecar(a, docs[:-1])
    assert not arguments.parse_args(BASE + ["--data-path", a], world_size=1).subq_loss_mask_data


def test_blend_file_prefixes_are_checked(tmp_path, capsys):
    docs = random_documents(40, 0, 100, seed=6)
    a = write_documents(tmp_path / "a", docs)
    write_sidecar(a, docs[:-2])
    blend = tmp_path / "data.blend"
    blend.write_text("a\n")
    err = _error(["--data-args-path", str(blend), "--subq-loss-mask-data"], capsys)
    assert f"sidecar {a}_lossmask does not match its data prefix {a}: 38 vs 40" in err


# ---- the loss ----------------------------------------------------------------------------------
def test_loss_func_of_an_all_zero_mask_is_zero_not_nan():
    """An all-zero micro-batch: loss sum 0 over 0 tokens; megatron's schedule divides by
    max(tokens, 1) (schedules.forward_step_calc_loss), so it adds 0 loss and 0 gradient."""
    from megatron_subq.training.trainer import loss_func

    losses = torch.rand(2, 16, requires_grad=True)
    loss, tokens, report = loss_func(torch.zeros(2, 16), losses)
    scaled = loss / torch.clamp(tokens, min=1)  # what megatron's schedule does with it
    scaled.backward()
    assert (float(scaled.detach()), int(tokens), report["lm loss"].tolist()) == (0.0, 0, [0.0, 0.0])
    assert float(losses.grad.abs().sum()) == 0.0


def _train_runs(flags, niah, zeros, work):
    from megatron_subq.training import pretrain

    out = {}
    for name, extra in (("plain", ["--data-path", niah]),
                        ("masked", ["--data-path", niah, "--subq-loss-mask-data"]),
                        ("zeros", ["--data-path", zeros, "--subq-loss-mask-data"])):
        metrics = os.path.join(work, name + ".jsonl")
        pretrain(flags + extra + ["--metrics-file", metrics])
        out[name] = [json.loads(line) for line in open(metrics)]
    return out


def test_trainer_trains_on_the_sidecar_mask(tmp_path):
    """The trainer end to end (one spawned process, three 6-iteration runs): a sidecar that
    keeps ~1 label in 10 (ids divisible by 10) gives finite losses that differ from the plain
    run's; an all-zero sidecar gives loss 0 and gradient norm 0, no NaN."""
    docs = random_documents(200, 0, 100, seed=7, max_len=60)
    niah = write_documents(tmp_path / "niah", docs)
    write_sidecar(niah, docs, value=lambda t: t % 10 == 0)
    zeros = write_documents(tmp_path / "zeros", docs)
    write_sidecar(zeros, docs, value=lambda t: np.zeros_like(t))
    flags = BASE + ["--seq-length", "32", "--train-iters", "6", "--log-interval", "1",
                    "--eval-interval", "1000", "--data-cache-path", str(tmp_path / "cache")]
    runs = run_distributed(_train_runs, 1, args=(flags, niah, zeros, str(tmp_path)))[0]
    loss = {name: [r["lm_loss"] for r in records if "lm_loss" in r]
            for name, records in runs.items()}
    assert all(len(v) == 6 for v in loss.values()), loss
    assert all(math.isfinite(x) for v in loss.values() for x in v), loss
    assert all(a != b for a, b in zip(loss["plain"], loss["masked"])), loss
    assert loss["zeros"] == [0.0] * 6
    norms = [r["grad_norm"] for r in runs["zeros"] if "grad_norm" in r]
    assert norms and all(n == 0.0 for n in norms), norms
