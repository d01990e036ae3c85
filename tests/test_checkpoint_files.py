"""Damaged checkpoint files and the --save lock, through the trainer on a real tiny checkpoint.

One spawned process (``run_distributed``, world 1) trains 4 iterations of a tiny mock-data GPT
saving at 2 and 4, then loads damaged copies (a truncated shard, garbage ``common.pt``, garbage
``.metadata``), a mismatched model shape, and runs the trainer against a locked --save folder.
The shared fixture takes ~40 s on 2 busy cores; the tests themselves are instant.
"""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.training import checkpointing, processes  # noqa: E402

# one shared fixture of ~30-40 s on 2 cores (a spawned process, 2 saves, 6 loads)

MIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--num-workers", "0", "--eval-iters", "0", "--eval-interval", "1000"]

# how each copy of the saved root is damaged (iteration 4 = the tracker's)
DAMAGE = {
    "truncated_shard": lambda f: _truncate(_first_shard(f), 10),
    "garbage_common": lambda f: _overwrite(os.path.join(f, "common.pt"), b"not a checkpoint"),
    "garbage_index": lambda f: _overwrite(os.path.join(f, ".metadata"), b"\x80\x04garbage"),
}


def _first_shard(folder):
    return os.path.join(folder, sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0])


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _overwrite(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _outcome(fn):
    """(exception class name, message, cause class name) of fn(), or None if it returned."""
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - SystemExit and CheckpointException included
        cause = e.__cause__
        return (type(e).__name__, str(e), type(cause).__name__ if cause else None)
    return None


def _scenarios(work):
    import contextlib
    import io

    from megatron_subq.training import pretrain

    out = {}
    root = os.path.join(work, "ckpt")
    out["first"] = pretrain(MIN + ["--train-iters", "4", "--save", root, "--save-interval", "2"])
    out["lock_left_after_run"] = os.path.exists(os.path.join(root, processes.LOCK_NAME))

    for name, damage in DAMAGE.items():
        copy = os.path.join(work, name)
        shutil.copytree(root, copy)
        damage(os.path.join(copy, "iter_0000004"))
        out[name] = _outcome(lambda c=copy: pretrain(MIN + ["--train-iters", "4", "--load", c,
                                                            "--skip-train"]))
        out[name + "_saved_args"] = _outcome(lambda c=copy: checkpointing.saved_args(c))
    # the earlier checkpoint named in the message loads
    out["earlier"] = pretrain(MIN + ["--train-iters", "4", "--load",
                                     os.path.join(work, "truncated_shard"), "--ckpt-step", "2",
                                     "--skip-train"])
    # a genuine user error: another model shape on an intact checkpoint
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out["shape"] = _outcome(lambda: pretrain(MIN + ["--hidden-size", "128", "--train-iters",
                                                        "4", "--load", root, "--skip-train"]))
    out["shape_stderr"] = err.getvalue()

    # a --save folder held by another run: start-up error, nothing written
    locked = os.path.join(work, "locked")
    holder = processes.SaveLock(locked).acquire()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            out["locked"] = _outcome(lambda: pretrain(MIN + ["--train-iters", "2", "--save",
                                                             locked, "--save-interval", "1"]))
        out["locked_files"] = sorted(os.listdir(locked))
    finally:
        holder.release()
    out["locked_stderr"] = err.getvalue()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt_files")
    [result] = run_distributed(_scenarios, world_size=1, args=(str(work),))
    return {"work": str(work), **result}


def test_the_trainer_releases_the_save_lock(runs):
    assert runs["first"]["iteration"] == 4
    assert runs["lock_left_after_run"] is False


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_names_folder_file_and_earlier_checkpoint(runs, damage):
    kind, message, cause = runs[damage]
    folder = os.path.join(runs["work"], damage, "iter_0000004")
    assert kind == "CheckpointReadError", runs[damage]
    assert f"checkpoint {folder} is damaged" in message
    damaged_file = {"truncated_shard": _first_shard(folder), "garbage_common":
                    os.path.join(folder, "common.pt"),
                    "garbage_index": os.path.join(folder, ".metadata")}[damage]
    assert damaged_file in message
    assert "--ckpt-step 2" in message and "iteration(s) 2;" in message
    assert cause is not None and cause != "CheckpointReadError"  # the original error is chained
    # tools/evaluate.py reads the arguments first, through saved_args
    assert runs[damage + "_saved_args"] is None or (
        runs[damage + "_saved_args"][0] == "CheckpointReadError"
        and f"checkpoint {folder} is damaged" in runs[damage + "_saved_args"][1])


def test_saved_args_names_a_damaged_common_file(runs):
    kind, message, _ = runs["garbage_common_saved_args"]
    assert kind == "CheckpointReadError"
    assert os.path.join(runs["work"], "garbage_common", "iter_0000004", "common.pt") in message


def test_the_earlier_checkpoint_loads(runs):
    assert runs["earlier"]["loaded_iteration"] == 2


def test_model_shape_mismatch_is_not_called_damage(runs):
    """Another --hidden-size on an intact checkpoint is the start-up error that names the flag
    and both values (training/checkpointing.py: prepare_load), not a damaged checkpoint."""
    kind, message, _ = runs["shape"]
    assert (kind, message) == ("SystemExit", "2")
    assert "damaged" not in runs["shape_stderr"]
    assert "--hidden-size: checkpoint 64, this run 128" in runs["shape_stderr"]


def test_locked_save_folder_fails_at_start_naming_the_holder(runs):
    kind, message, _ = runs["locked"]
    assert (kind, message) == ("SystemExit", "2")
    lock = os.path.join(runs["work"], "locked", processes.LOCK_NAME)
    assert f"`--save {os.path.dirname(lock)}` is in use" in runs["locked_stderr"]
    assert lock in runs["locked_stderr"] and "PID " in runs["locked_stderr"]
    assert runs["locked_files"] == [processes.LOCK_NAME]  # nothing else written


def test_damaged_files_and_complete_checkpoints(runs, tmp_path):
    """The scan alone: an intact folder has no damage; every damaged copy is found; a
    ``.partial`` folder and a damaged one are not complete."""
    root = os.path.join(runs["work"], "ckpt")
    assert checkpointing.damaged_files(os.path.join(root, "iter_0000004")) == []
    assert checkpointing.complete_checkpoints(root) == [2, 4]
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    shutil.copytree(copy / "iter_0000004", copy / "iter_0000006.partial")
    os.remove(copy / "iter_0000004" / "metadata.json")
    assert checkpointing.damaged_files(str(copy / "iter_0000004")) == [
        f"{copy / 'iter_0000004' / 'metadata.json'}: missing"]
    assert checkpointing.complete_checkpoints(str(copy)) == [2]
    message = checkpointing.describe_damage(str(copy / "iter_0000002"))
    assert "There is no other complete checkpoint" in message
    json.dumps(message)  # plain text
