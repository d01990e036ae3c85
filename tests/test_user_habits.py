"""Habits of Megatron-LM users: adjusted flags are announced, impossible ones refused at start-up,
and a resumed run follows the LR/WD schedule the user chose (Megatron-LM's
--override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler), never a silent one."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.training import arguments  # noqa: E402
from megatron_subq.training.checkpointing import check_scheduler  # noqa: E402
from test_trainer import MIN, _error  # noqa: E402 - the trainer tests' minimal flags


def test_sequence_parallel_at_tp1_is_announced(capsys):
    args = arguments.parse_args(MIN + ["--sequence-parallel"])
    assert not args.sequence_parallel
    out = capsys.readouterr().out
    assert "note: --sequence-parallel has no effect at --tensor-model-parallel-size 1" in out
    arguments.parse_args(MIN)
    assert "sequence-parallel" not in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_fp16_on_the_cpu_is_refused_at_start(capsys):
    assert "--fp16 needs CUDA" in _error(MIN + ["--fp16"], capsys)


def test_both_scheduler_sources_conflict(capsys):
    err = _error(MIN + ["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"],
                 capsys)
    assert "--override-opt-param-scheduler conflicts with --use-checkpoint-opt-param-scheduler" \
        in err


def _scheduler(lr=1e-3, decay=100, min_lr=0.0, override=False, use_checkpoint=False):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=10, lr_decay_steps=decay,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=decay,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=use_checkpoint,
        override_opt_param_scheduler=override)


def _args(override=False, use_checkpoint=False):
    return arguments.parse_args(MIN + ["--load", "ckpt"] + (
        ["--override-opt-param-scheduler"] if override else []) + (
        ["--use-checkpoint-opt-param-scheduler"] if use_checkpoint else []))


def test_a_changed_schedule_on_load_is_an_error_naming_both_flags():
    saved = _scheduler(lr=1e-3, decay=100)
    saved.step(increment=40)
    state = saved.state_dict()
    logs = []
    check_scheduler(_args(), _scheduler(lr=1e-3, decay=100), state, log=logs.append)
    assert logs == ["> LR/WD schedule: the flags and the checkpoint agree"]
    with pytest.raises(ValueError) as e:
        check_scheduler(_args(), _scheduler(lr=3e-3, decay=200), state, log=logs.append)
    message = str(e.value)
    assert "learning rate (--lr): flags 0.003, checkpoint 0.001" in message
    assert "decay samples" in message and "flags 200, checkpoint 100" in message
    assert "--use-checkpoint-opt-param-scheduler" in message
    assert "--override-opt-param-scheduler" in message


@pytest.mark.parametrize("source", ["override", "checkpoint"])
def test_the_chosen_schedule_is_announced_and_followed(source):
    """The announcement matches what megatron's scheduler then does with the checkpoint."""
    saved = _scheduler(lr=1e-3, decay=100)
    saved.step(increment=40)
    override, use_checkpoint = source == "override", source == "checkpoint"
    live = _scheduler(lr=3e-3, decay=200, override=override, use_checkpoint=use_checkpoint)
    logs = []
    check_scheduler(_args(override, use_checkpoint), live, saved.state_dict(), log=logs.append)
    live.load_state_dict(saved.state_dict())
    assert live.num_steps == 40
    if override:
        assert "from the flags (--override-opt-param-scheduler)" in logs[0]
        assert "learning rate 0.003 (checkpoint 0.001)" in logs[0]
        assert (live.max_lr, live.lr_decay_steps) == (3e-3, 200)
    else:
        assert "from the checkpoint (--use-checkpoint-opt-param-scheduler)" in logs[0]
        assert "learning rate 0.001 (flags 0.003)" in logs[0]
        assert (live.max_lr, live.lr_decay_steps) == (1e-3, 100)


def test_kernel_launch_overrides_are_announced_and_saved(tmp_path, monkeypatch, capsys):
    """The MEGATRON_SUBQ_*_LAUNCH JSON overrides change what the kernels run: a run says so at
    start-up and its checkpoint's arguments keep them."""
    import json

    from megatron_subq.training import pretrain
    from megatron_subq.training.checkpointing import saved_args

    monkeypatch.setenv("MEGATRON_SUBQ_ASA_LAUNCH", '{"BT": 64}')
    save = str(tmp_path / "ckpt")
    pretrain(MIN[:10] + ["--train-iters", "1"] + MIN[12:] + [
        "--global-batch-size", "2", "--num-workers", "0", "--eval-iters", "0",
        "--save", save])
    out = capsys.readouterr().out
    assert '> kernel launch override in force: MEGATRON_SUBQ_ASA_LAUNCH={"BT": 64}' in out
    stored = json.loads(saved_args(save)["kernel_launch_overrides"])
    assert stored == {"MEGATRON_SUBQ_ASA_LAUNCH": '{"BT": 64}'}
