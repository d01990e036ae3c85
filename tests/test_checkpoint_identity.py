"""A loaded checkpoint is the model that was saved (issue 16, items 1, 2, 7).

* the padded vocabulary is the checkpoint's at any TP that divides it (its padding rows take part
  in the softmax), and a TP that does not divide it is refused;
* a checkpoint of another model (variant, knobs, shape) is an error listing every difference,
  unless --use-checkpoint-args (take them) or --allow-model-change (load on purpose);
* a finished run says how to continue; --save holding another model's run is warned about.

One two-process spawn runs every trainer case on mock data with a 300-token vocabulary (the tiny
tokenizer's size), so it does not depend on mistral-common.
"""

import contextlib
import io
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.training import arguments  # noqa: E402
from megatron_subq.training.checkpointing import _saved_args, model_mismatches  # noqa: E402
from megatron_subq.training.tokenizer import padded_vocab_size_for_load  # noqa: E402

MIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


# ---- the vocabulary rule (no processes) -------------------------------------------------------
def test_padded_vocab_keeps_the_checkpoints_size_where_tp_divides_it():
    # no checkpoint: Megatron-LM's padding
    assert padded_vocab_size_for_load(300, 128, 1, None) == (384, None)
    # a TP=2 checkpoint of 300 tokens (512 rows), stored, loaded at TP=1 and TP=4
    vocab, note = padded_vocab_size_for_load(300, 128, 1, {"padded_vocab_size": 512})
    assert vocab == 512 and "keeping the checkpoint's padded size 512" in note and "384" in note
    assert padded_vocab_size_for_load(300, 128, 4, {"padded_vocab_size": 512})[0] == 512
    # an older checkpoint without the stored size: derived from its divisible-by and TP
    old = {"make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 4}
    assert padded_vocab_size_for_load(32000, 128, 1, old)[0] == 32256
    assert padded_vocab_size_for_load(32000, 128, 2, dict(old, tokenizer_vocab_size=32000))[0] \
        == 32256
    # the same size as a fresh run: no note
    assert padded_vocab_size_for_load(32000, 128, 1, {"padded_vocab_size": 32000}) == (32000, None)


def test_padded_vocab_refuses_a_tp_that_does_not_divide_it():
    with pytest.raises(ValueError) as e:
        padded_vocab_size_for_load(300, 128, 5, {"padded_vocab_size": 384})
    msg = str(e.value)
    assert "--tensor-model-parallel-size 5 is invalid" in msg and "384 rows" in msg
    assert "--make-vocab-size-divisible-by 128" in msg and "a TP size that divides 384" in msg
    with pytest.raises(ValueError, match="fewer than this tokenizer's 32000"):
        padded_vocab_size_for_load(32000, 128, 1, {"padded_vocab_size": 384})


# ---- the model comparison (no processes) ------------------------------------------------------
def test_model_mismatches_name_every_differing_flag():
    saved = _saved_args(arguments.parse_args(MIN + ["--attention-variant", "asa", "--asa-rank",
                                                    "8", "--ppa-power", "0.3"], world_size=1))
    same = arguments.parse_args(MIN + ["--attention-variant", "asa", "--asa-rank", "8",
                                       "--lr", "5e-4", "--subq-impl", "reference"], world_size=1)
    assert model_mismatches(saved, same) == []  # lr, implementation, unused ppa knob: same model
    other = arguments.parse_args(MIN + ["--hidden-size", "128", "--no-swiglu"], world_size=1)
    found = model_mismatches(saved, other)
    assert found[0].startswith("--attention-variant/--layer-pattern: checkpoint asa (layers "
                               "asa,asa), this run standard (layers standard,standard)")
    flags = {m.split(":")[0] for m in found[1:]}
    assert flags == {"--hidden-size", "--swiglu", "--ffn-hidden-size", "--kv-channels",
                     "--asa-rank"}, found
    assert "--hidden-size: checkpoint 64, this run 128" in found
    # a named pattern and the list it stands for are the same model
    listed = arguments.parse_args(MIN + ["--attention-variant", "asa", "--asa-rank", "8",
                                         "--layer-pattern", "asa,asa"], world_size=1)
    assert model_mismatches(saved, listed) == []


def test_new_flags_need_load(capsys):
    for flag in ("--allow-model-change", "--use-checkpoint-args"):
        with pytest.raises(SystemExit):
            arguments.parse_args(MIN + [flag], world_size=1)
        assert f"{flag} needs --load" in capsys.readouterr().err


# ---- the trainer (one spawn of two processes) -------------------------------------------------
def _trainer_cases(base, work):
    import torch.distributed as dist

    from megatron_subq.training import pretrain

    def run(argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                summary = pretrain(base + argv)
            except SystemExit as e:
                summary = {"exit": e.code}
            except BaseException as e:  # noqa: BLE001 - raw failures (torch.distributed.checkpoint
                # raises BaseException subclasses) are reported by the tests
                summary = {"exception": f"{type(e).__name__}: {e}"[:2000]}
        return summary, out.getvalue() + err.getvalue()

    save = os.path.join(work, "tp2")
    results = {}
    # item 1: 300 tokens padded to 512 at TP=2, loaded at TP=1 (DP=2)
    results["tp2"] = run(["--tensor-model-parallel-size", "2", "--train-iters", "2",
                          "--save", save, "--eval-interval", "2"])
    results["tp1"] = run(["--load", save, "--skip-train"])
    # item 2: another variant is an error; --use-checkpoint-args / --allow-model-change load
    results["asa"] = run(["--load", save, "--skip-train", "--attention-variant", "asa",
                          "--asa-rank", "8", "--num-layers", "3"])
    results["use_args"] = run(["--load", save, "--skip-train", "--use-checkpoint-args",
                               "--attention-variant", "asa", "--asa-rank", "8"])
    results["allow"] = run(["--load", save, "--skip-train", "--allow-model-change",
                            "--attention-variant", "asa", "--asa-rank", "8"])
    # item 7: a finished run; a --save folder holding another model
    results["finished"] = run(["--load", save, "--train-iters", "2"])
    results["save_other"] = run(["--train-iters", "1", "--save", save, "--save-interval", "100",
                                 "--num-layers", "1", "--eval-iters", "0"])
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("identity"))
    base = MIN[:MIN.index("--train-iters")] + MIN[MIN.index("--lr"):] + [
        "--global-batch-size", "4", "--num-workers", "0", "--eval-iters", "1",
        "--log-interval", "1", "--seed", "7"]
    results = run_distributed(_trainer_cases, world_size=2, args=(base, work))
    return results[0], results[1]


def test_tp2_checkpoint_of_300_tokens_loads_at_tp1_with_the_same_loss(cases):
    (tp2, log2), (tp1, log1) = cases[1]["tp2"], cases[1]["tp1"]
    assert tp1["loaded_iteration"] == 2, log1
    assert tp1["valid"][2] == pytest.approx(tp2["valid"][2], rel=1e-5), (log2, log1)
    assert "vocab 512 (tokenizer 301)" in cases[0]["tp2"][1]
    assert "keeping the checkpoint's padded size 512" in cases[0]["tp1"][1]


def test_another_variant_is_an_error_listing_every_difference(cases):
    summary, log = cases[0]["asa"]
    assert summary == {"exit": 2}, log
    assert "holds a different model than this run asks for" in log
    assert "--attention-variant/--layer-pattern: checkpoint standard" in log
    assert "--num-layers: checkpoint 2, this run 3" in log
    assert "--allow-model-change" in log and "--use-checkpoint-args" in log


def test_use_checkpoint_args_and_allow_model_change(cases):
    summary, log = cases[0]["use_args"]
    assert summary["loaded_iteration"] == 2, log
    assert "--use-checkpoint-args: from" in log and "--attention-variant standard" in log
    assert "layers: standard,standard" in log
    assert summary["valid"][2] == pytest.approx(cases[1]["tp1"][0]["valid"][2], rel=1e-5)
    summary, log = cases[0]["allow"]
    assert "valid" in summary, log
    assert "--allow-model-change: this model differs" in log and "keep their initial values" in log


def test_finished_run_says_how_to_continue(cases):
    summary, log = cases[0]["finished"]
    assert summary["loaded_iteration"] == 2 and summary["iterations"] == {}
    assert "nothing to train" in log and "raise --train-iters above 2" in log


def test_save_folder_of_another_model_is_warned_about(cases):
    summary, log = cases[0]["save_other"]
    assert sorted(summary["iterations"]) == [1], log
    warnings = [ln for ln in log.splitlines() if "warning: --save" in ln]
    assert len(warnings) == 1 and "--num-layers: checkpoint 2, this run 1" in warnings[0]
    assert "warning: --save" not in cases[1]["save_other"][1]  # rank 0 only
