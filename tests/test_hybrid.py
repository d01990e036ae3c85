"""The hybrid host (Mamba-2 + attention + MLP + MoE, Nemotron-H layout) on the CPU.

TP=2 + SP, PP=2 and EP=2 train one step exactly as TP=1 (loss, every parameter's gradient as
megatron's finalize_model_grads combines it, the router's expert-bias update), with standard,
superlinear and asa in the attention slots; torch_dist checkpoints reshard TP=2 -> 1 and
EP=2 -> 1; the trainer resumes bitwise; the Nano preset has the published parameter count.
Process launches are few on purpose: one 2-rank world runs every layout in turn.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.testing.hybrid import (  # noqa: E402
    HYBRID_TEST_PATTERN,
    hybrid_suite,
    hybrid_trainer_resume,
    nano_parameter_counts,
)

NO_MOE = HYBRID_TEST_PATTERN.replace("E", "-")  # megatron's MoE layer refuses TP without SP
LAYOUTS = [dict(), dict(tp=2, sp=True), dict(pp=2), dict(ep=2),
           dict(hybrid_override_pattern=NO_MOE), dict(tp=2, hybrid_override_pattern=NO_MOE)]


def _assert_step_equal(got, ref, what):
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), what
    assert set(got["grads"]) == set(ref["grads"]), f"{what}: parameter sets differ"
    for name, g in ref["grads"].items():
        scale = g.abs().max().item() + 1e-6
        err = (got["grads"][name] - g).abs().max().item()
        assert err <= 2e-4 * scale, f"{what}: gradient of {name} differs by {err:.3g} ({scale:.3g})"
    assert set(got["expert_bias"]) == set(ref["expert_bias"])
    for name, b in ref["expert_bias"].items():
        torch.testing.assert_close(got["expert_bias"][name], b, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every layout's training step and the checkpoint round trips, in one 2-rank launch."""
    return run_distributed(hybrid_suite, 2, args=(LAYOUTS, str(tmp_path_factory.mktemp("ck"))))


def test_tp_sp_pp_ep_equal_tp1(suite):
    ref, tp_sp, pp, ep, ref_dense, tp_dense = suite[0]["layouts"]
    assert len(ref["grads"]) > 40 and ref["expert_bias"], "the tiny hybrid has every layer kind"
    assert any(".mixer.in_proj." in n for n in ref["grads"]), "Mamba layers take part"
    assert any("linear_qs" in n for n in ref["grads"]) and any("p_q" in n for n in ref["grads"])
    # the expert bias moved (the update ran) and the router was trained
    assert all(b.abs().max() > 0 for b in ref["expert_bias"].values())
    for got, what in ((tp_sp, "TP=2+SP"), (pp, "PP=2"), (ep, "EP=2")):
        _assert_step_equal(got, ref, what)
        # the trainer's parameter count sees every rank's share (EP: the other rank's experts)
        assert got["parameters"] == ref["parameters"], what
    _assert_step_equal(tp_dense, ref_dense, "TP=2 (no MoE layers)")
    assert suite[1]["layouts"][0]["loss"] == ref["loss"]


def test_checkpoint_reshards_tp2_to_tp1_and_ep2_to_ep1(suite):
    out = suite[0]["reshard"]
    for name in ("tp", "ep"):
        saved, loaded = out[f"{name}_saved"], out[f"{name}_loaded"]
        torch.testing.assert_close(loaded["logits"], saved["logits"], rtol=1e-5, atol=1e-5)
        assert set(loaded["expert_bias"]) == set(saved["expert_bias"]) != set()
        for key, bias in saved["expert_bias"].items():
            assert torch.equal(loaded["expert_bias"][key], bias), key


def _recipe_flags(path, drop=("data-path", "split", "tokenizer-type", "tokenizer-model", "save",
                              "save-interval", "metrics-file", "train-iters", "log-interval",
                              "eval-interval", "eval-iters")):
    """A recipe YAML as flags, without its data, tokenizer and output settings."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    flags = []
    for key, value in data.items():
        if key in drop:
            continue
        if value is True:
            flags.append(f"--{key}")
        elif value is not False:
            flags.append(f"--{key}={value}")
    return flags


def test_trainer_resumes_bitwise_with_the_expert_bias(tmp_path):
    flags = _recipe_flags(os.path.join(ROOT, "recipes", "tiny-hybrid-cpu.yaml"))
    out = run_distributed(hybrid_trainer_resume, 1, args=(str(tmp_path), flags))[0]
    a, b = out["a_metrics"], out["b_metrics"]
    assert sorted(b) == [3, 4] and sorted(a) == [1, 2, 3, 4]
    for it in (3, 4):
        assert (b[it]["lm_loss"], b[it]["grad_norm"]) == (a[it]["lm_loss"], a[it]["grad_norm"])
        assert b[it]["seq_load_balancing_loss"] == a[it]["seq_load_balancing_loss"] > 0
    ta, tb = out["a_tensors"], out["b_tensors"]
    assert set(ta) == set(tb)
    biases = [k for k in ta if k.endswith("router.expert_bias")]
    assert len(biases) == 2 and any(ta[k].abs().max() > 0 for k in biases)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


HYBRID_MIN = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr",
              "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
              "--hybrid-override-pattern=M*E-", "--num-experts", "4", "--mamba-head-dim", "16",
              "--mamba-num-groups", "2", "--mamba-state-dim", "16"]


def _error(argv, capsys, world_size=1, config=False):
    from megatron_subq.training import arguments
    from megatron_subq.training.trainer import build_config

    with pytest.raises(SystemExit) as e:
        args = arguments.parse_args(argv, world_size=world_size)
        if config:
            build_config(args)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_hybrid_flags_fail_at_start_naming_the_flag(capsys):
    from megatron_subq.training import arguments

    args = arguments.parse_args(HYBRID_MIN + ["--attention-variant", "superlinear"], world_size=1)
    assert args.is_hybrid_model and args.position_embedding_type == "none"
    err = _error(HYBRID_MIN + ["--attention-variant", "rnd_emb_qk"], capsys, config=True)
    assert "--attention-variant" in err and "hybrid host" in err
    assert "exactly --num-layers=5" in _error(HYBRID_MIN + ["--num-layers", "5"], capsys)
    assert "allowed symbols" in _error(HYBRID_MIN + ["--hybrid-override-pattern=M*X-"], capsys)
    i = HYBRID_MIN.index("--num-experts")
    assert "give --num-experts" in _error(HYBRID_MIN[:i] + HYBRID_MIN[i + 2:], capsys)
    assert "--is-hybrid-model needs --hybrid-override-pattern" in _error(
        HYBRID_MIN[:19] + ["--is-hybrid-model"], capsys)
    assert "--sequence-parallel" in _error(HYBRID_MIN + ["--tensor-model-parallel-size", "2"],
                                           capsys, world_size=2)
    assert "--expert-model-parallel-size=3" in _error(
        HYBRID_MIN + ["--expert-model-parallel-size", "3"], capsys, world_size=3)
    assert "allowed on the CPU: allgather" in _error(
        HYBRID_MIN + ["--moe-token-dispatcher-type", "alltoall"], capsys)
    assert "Mamba layers" in _error(HYBRID_MIN + ["--reset-attention-mask"], capsys)


def test_preset_and_pattern_errors_name_the_field():
    import megatron_subq
    from megatron_subq import SubqTransformerConfig, hybrid_preset

    assert megatron_subq.build_hybrid_model is megatron_subq.hybrid.build_hybrid_model

    with pytest.raises(ValueError, match="hybrid preset 'nano'.*allowed"):
        hybrid_preset("nano")
    with pytest.raises(ValueError, match="override colour= is unknown"):
        hybrid_preset("tiny-hybrid", colour=1)
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="hybrid_override_pattern='M\\*E'.*exactly num_layers=4"):
        SubqTransformerConfig(**base, hybrid_override_pattern="M*E")
    with pytest.raises(ValueError, match="num_moe_experts"):
        SubqTransformerConfig(**base, hybrid_override_pattern="M*E-")
    with pytest.raises(ValueError, match="layer_pattern has 3 entries.*'\\*' slots"):
        SubqTransformerConfig(**base, hybrid_override_pattern="M*-*",
                              layer_pattern=["asa", "asa", "asa"])
    with pytest.raises(ValueError, match="attention_variant='static_emb_qk'.*hybrid host"):
        SubqTransformerConfig(**base, hybrid_override_pattern="M*-*",
                              attention_variant="static_emb_qk")
    config = SubqTransformerConfig(**base, hybrid_override_pattern="M*-*",
                                   attention_variant="asa", layer_pattern="hybrid")
    assert config.layer_variants == [None, "asa", None, "standard"]
    assert config.attention_layers == [2, 4] and config.is_hybrid_model


def test_nano_preset_has_the_published_size_without_allocating():
    """Nemotron-3-Nano-30B-A3B built on the meta device: 31,577,937,344 parameters, 3.58B
    active per token; superlinear in the six '*' slots adds exactly six search projections."""
    counts = run_distributed(nano_parameter_counts, 1)[0]
    assert counts["standard"] == (31_577_937_344, 3_580_073_408)
    assert counts["superlinear"][0] - counts["standard"][0] == 6 * 2688 * 4096
    assert counts["devices"] == ["meta"]
