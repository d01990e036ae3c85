"""Context parallelism: CP=2 reproduces CP=1, for every variant with a CP path.

Every variant whose ``Variant.context_parallel`` is "all_to_all" is a case (settings from
``megatron_subq.testing.cases``): the same tiny GPT, seed and data at CP=2 (each rank its zig-zag
halves, ``testing.equivalence.tiny_gpt_cp_step``) gives TP=1's per-token loss and every
parameter's gradient within fp32 tolerance. Two process launches serve them all (a world of one
for the references, a world of two for CP=2, which also runs the trainer at CP=2 and CP=1 and
loads the CP=2 checkpoint at CP=1); CP=2 x TP=2 needs a world of four (marked slow). The
hybrid host (Mamba-2 + attention + MoE, ``testing.hybrid.hybrid_cp_step``) rides in the world of
two: CP=2 against CP=1 there, and its trainer at CP=2 against CP=1 (DP=2); CP=2 x TP=2 + SP and
the trainer with EP and PP need a world of four (slow). The refusals run in-process.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq import VARIANTS, SubqTransformerConfig  # noqa: E402
from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.testing.cases import (VARIANT_TEST_TOLERANCES,  # noqa: E402
                                         variant_test_settings)
from megatron_subq.testing.equivalence import TINY, every_case_every_layout  # noqa: E402
from megatron_subq.training import arguments  # noqa: E402

CP_VARIANTS = sorted(n for n, v in VARIANTS.items() if v.context_parallel == "all_to_all")
CASES = [(name, variant_test_settings(name)) for name in CP_VARIANTS] + [
    # one key/value head for two CP ranks: replicated before the exchange; asa's per-head
    # P_Q/P_K are sliced per CP rank
    ("asa-mqa", {**variant_test_settings("asa"), "num_query_groups": 1})] + [
    # state passing instead of the all-to-all, each normalisation
    (f"asa-state-passing-{mode}", {**variant_test_settings("asa"), "asa_normalize": mode,
                                   "context_parallel_scheme": "state_passing"})
    for mode in ("linear", "mean", "none")] + [
    (f"{name}-state-passing", {**variant_test_settings(name),
                                "context_parallel_scheme": "state_passing"})
    for name in ("approx", "nonapprox")] + [
    # the same on their Triton kernels, interpreted (the ranks' tensors are on the CPU): the
    # kernel returns the starting state's gradient (CP=1 runs the kernel too)
    (f"{name}-state-passing-kernel", {**variant_test_settings(name), "subq_impl": "kernel",
                                       "context_parallel_scheme": "state_passing"})
    for name in ("approx", "nonapprox") if os.environ.get("TRITON_INTERPRET") == "1"] + [
    (f"asa-state-passing-kernel-{mode}", {**variant_test_settings("asa"), "asa_normalize": mode,
                                          "subq_impl": "kernel",
                                          "context_parallel_scheme": "state_passing"})
    for mode in ("linear", "mean", "none") if os.environ.get("TRITON_INTERPRET") == "1"]
TP_CASES = [(name, variant_test_settings(name)) for name in ("standard", "superlinear")]

# the hybrid host: (name, pattern, attention slots, config overrides); Mamba groups split over
# CP (2 groups) and replicated (1 group)
HYBRID_CASES = [("hybrid", "M*M*E", ["standard", "superlinear"], {}),
                ("hybrid-one-group", "M*E", ["standard"], {"mamba_num_groups": 1})]
HYBRID_TRAINER = ["--is-hybrid-model", "--hybrid-override-pattern=M*E-", "--num-layers", "4",
                  "--num-experts", "4", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
                  "--mamba-state-dim", "16"]

TRAINER = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--num-query-groups", "2", "--seq-length", "32", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style",
           "cosine", "--lr-warmup-iters", "1", "--num-workers", "0", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--eval-iters", "1",
           "--eval-interval", "100", "--log-interval", "1", "--seed", "1234",
           "--train-iters", "3"]


def cp_suite(cases, save_dir):
    """In a world of two: every case at CP=2; the trainer at CP=2 (distributed optimizer, saving
    its last iteration), at CP=1 (DP=2: the same samples per step), and the CP=2 checkpoint
    loaded at CP=1 for validation; the hybrid cases at CP=1 and CP=2, and the hybrid trainer at
    CP=2 and CP=1."""
    from megatron_subq.testing.hybrid import hybrid_cp_suite
    from megatron_subq.training import pretrain

    out = {"layouts": every_case_every_layout(cases, ["cp2"])}
    out["hybrid"] = hybrid_cp_suite(HYBRID_CASES)
    hybrid = TRAINER + HYBRID_TRAINER + ["--eval-iters", "0"]
    out["hybrid_trainer_cp2"] = pretrain(hybrid + ["--context-parallel-size", "2"])
    out["hybrid_trainer_cp1"] = pretrain(hybrid)
    out["trainer_cp2"] = pretrain(TRAINER + ["--context-parallel-size", "2",
                                             "--use-distributed-optimizer", "--save", save_dir,
                                             "--save-interval", "3"])
    out["trainer_cp1"] = pretrain(TRAINER)
    out["loaded_cp1"] = pretrain(TRAINER + ["--load", save_dir, "--skip-train"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ref = run_distributed(every_case_every_layout, 1, args=(CASES, ["tp1"]))[0]
    save = str(tmp_path_factory.mktemp("cp") / "ckpt")
    ranks = run_distributed(cp_suite, 2, args=(CASES, save))
    return {"ref": ref, "ranks": ranks}


def _get(result, what):
    if isinstance(result, tuple) and result and result[0] == "error":
        pytest.fail(f"{what} failed:\n{result[1]}")
    return result


def _assert_matches(got, ref, name, what):
    tol = {"rtol": 1e-4, "atol": 1e-5,
           **VARIANT_TEST_TOLERANCES.get(name.split("-")[0], {})}
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"{what} loss: {m}")
    assert set(got["grads"]) == set(ref["grads"]), "different parameter sets"
    for pname, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][pname], g, **tol,
                                   msg=lambda m, p=pname: f"{what} grad of {p}: {m}")


@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_cp2_equals_cp1(results, name, kwargs):
    ref = _get(results["ref"][name]["tp1"], f"{name} at CP=1")
    for rank, r in enumerate(results["ranks"]):
        got = _get(r["layouts"][name]["cp2"], f"{name} at CP=2, rank {rank}")
        _assert_matches(got, ref, name, f"{name} CP=2 rank {rank}")


def test_trainer_cp2_matches_cp1_and_its_checkpoint_loads_at_cp1(results):
    last = results["ranks"][-1]
    cp2, cp1 = last["trainer_cp2"]["iterations"], last["trainer_cp1"]["iterations"]
    assert sorted(cp2) == sorted(cp1) == [1, 2, 3]
    for it in cp1:
        assert cp2[it] == pytest.approx(cp1[it], rel=1e-5, abs=1e-5), (it, cp2, cp1)
    valid_cp2 = last["trainer_cp2"]["valid"][3]
    assert last["loaded_cp1"]["loaded_iteration"] == 3
    assert last["loaded_cp1"]["valid"][3] == pytest.approx(valid_cp2, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", [c[0] for c in HYBRID_CASES])
def test_hybrid_cp2_equals_cp1(results, name):
    """The hybrid host at CP=2 (Mamba-2 layers through the head all-to-all, attention through
    the variant's CP path, MoE per token): CP=1's loss and every parameter's gradient."""
    for rank, r in enumerate(results["ranks"]):
        ref = _get(r["hybrid"][name][(1, 1, False)], f"{name} at CP=1, rank {rank}")
        got = _get(r["hybrid"][name][(2, 1, False)], f"{name} at CP=2, rank {rank}")
        assert got["cp_mixers"] > 0, "no Mamba layer took the context-parallel path"
        assert ref["cp_mixers"] == 0
        _assert_matches(got, ref, "standard", f"{name} CP=2 rank {rank}")


def test_hybrid_trainer_cp2_matches_cp1(results):
    last = results["ranks"][-1]
    cp2 = last["hybrid_trainer_cp2"]["iterations"]
    cp1 = last["hybrid_trainer_cp1"]["iterations"]
    assert sorted(cp2) == sorted(cp1) == [1, 2, 3]
    for it in cp1:
        assert cp2[it] == pytest.approx(cp1[it], rel=1e-5, abs=1e-5), (it, cp2, cp1)


def cp_tp_suite(cases):
    """In a world of four: the cases at TP=1, CP=2 x TP=2 and CP=2 x TP=2 + SP; the trainer at
    CP=2 x TP=2 + SP against TP=2 + SP (DP=2), and at CP=2 x PP=2 against PP=2 (DP=2)."""
    from megatron_subq.training import pretrain

    out = {"layouts": every_case_every_layout(cases, ["tp1", "cp2-tp2", "cp2-tp2-sp"])}
    for name, extra in (("tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("pp2", ["--pipeline-model-parallel-size", "2"])):
        out[f"trainer_{name}"] = pretrain(TRAINER + extra + ["--eval-iters", "0"])
        out[f"trainer_cp2_{name}"] = pretrain(TRAINER + extra + ["--eval-iters", "0",
                                                                 "--context-parallel-size", "2"])
    return out


def hybrid_cp_tp_suite():
    """In a world of four: the hybrid case at CP=1 and CP=2 x TP=2 + SP; the hybrid trainer at
    CP=2 combined with TP=2 + SP, with EP=2 and with PP=2, each against the same without CP
    (more DP)."""
    from megatron_subq.testing.hybrid import hybrid_cp_suite
    from megatron_subq.training import pretrain

    out = {"layouts": hybrid_cp_suite(HYBRID_CASES[:1], [(1, 1, False), (2, 2, True)])}
    base = TRAINER + HYBRID_TRAINER + ["--eval-iters", "0", "--global-batch-size", "8"]
    for name, extra in (("tp2-sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("ep2", ["--expert-model-parallel-size", "2"]),
                        ("pp2", ["--pipeline-model-parallel-size", "2"])):
        out[f"trainer_{name}"] = pretrain(base + extra)
        out[f"trainer_cp2_{name}"] = pretrain(base + extra + ["--context-parallel-size", "2"])
    return out


@pytest.mark.slow
def test_hybrid_cp2_tp2_sp_equals_cp1():
    """The hybrid host at CP=2 x TP=2 + SP in a world of four (Mamba heads 8 / TP 2 / CP 2;
    its 2 groups, one per TP rank, replicated over CP): CP=1's loss and gradients. The trainer
    combines CP with TP + SP, with EP and with PP (the same losses as without CP)."""
    ranks = run_distributed(hybrid_cp_tp_suite, 4)
    name = HYBRID_CASES[0][0]
    for rank, r in enumerate(ranks):
        ref = _get(r["layouts"][name][(1, 1, False)], f"{name} at CP=1, rank {rank}")
        got = _get(r["layouts"][name][(2, 2, True)], f"{name} at CP=2 x TP=2 + SP, rank {rank}")
        assert got["cp_mixers"] > 0
        _assert_matches(got, ref, "standard", f"{name} CP=2 x TP=2 + SP rank {rank}")
    last = ranks[-1]
    for layout in ("tp2-sp", "ep2", "pp2"):
        ref = last[f"trainer_{layout}"]["iterations"]
        got = last[f"trainer_cp2_{layout}"]["iterations"]
        assert sorted(got) == sorted(ref) == [1, 2, 3], layout
        for it in ref:
            assert got[it] == pytest.approx(ref[it], rel=1e-5, abs=1e-5), (layout, it, got, ref)


@pytest.mark.slow
def test_cp2_tp2_equals_tp1():
    """CP=2 x TP=2 (with and without SP) in a world of four, for standard and superlinear:
    superlinear's search queries ride along their query heads, and with 1 key/value head per
    TP rank the exchange replicates it over the two CP ranks. The trainer combines CP with
    TP + SP and with PP (the same losses as without CP)."""
    ranks = run_distributed(cp_tp_suite, 4, args=(TP_CASES,))
    for name, _ in TP_CASES:
        ref = _get(ranks[0]["layouts"][name]["tp1"], f"{name} at TP=1")
        for rank, r in enumerate(ranks):
            for layout in ("cp2-tp2", "cp2-tp2-sp"):
                got = _get(r["layouts"][name][layout], f"{name} at {layout}, rank {rank}")
                _assert_matches(got, ref, name, f"{name} {layout} rank {rank}")
    last = ranks[-1]
    for name in ("tp2-sp", "pp2"):
        ref, got = last[f"trainer_{name}"]["iterations"], last[f"trainer_cp2_{name}"]["iterations"]
        assert sorted(got) == sorted(ref) == [1, 2, 3], name
        for it in ref:
            assert got[it] == pytest.approx(ref[it], rel=1e-5, abs=1e-5), (name, it, got, ref)


# ---- refusals (no processes) -------------------------------------------------------------------
HYBRID_MAMBA = {"hybrid_override_pattern": "M*", "num_layers": 2, "mamba_head_dim": 16,
                "mamba_state_dim": 16}


@pytest.mark.parametrize("kwargs,needle", [
    (variant_test_settings("sas"), "context_parallel_size=2 is invalid with sas layers"),
    (variant_test_settings("rnd_emb_qk"),
     "context_parallel_size=2 is invalid with rnd_emb_qk layers"),
    ({"attention_variant": "asa", "layer_pattern": ["asa", "sas"]},
     "context_parallel_size=2 is invalid with sas layers"),
    ({**HYBRID_MAMBA, "mamba_num_heads": 3, "mamba_num_groups": 1},
     "context_parallel_size=2 is invalid with the hybrid host: allowed a divisor of the Mamba "
     "heads per tensor-parallel rank (3 / tensor_model_parallel_size=1 = 3"),
    ({**HYBRID_MAMBA, "mamba_num_heads": 6, "mamba_num_groups": 3},
     "allowed a divisor or a multiple of the Mamba groups per tensor-parallel rank "
     "(mamba_num_groups=3 / 1 = 3"),
    ({**HYBRID_MAMBA, "layer_pattern": ["sas"]},
     "context_parallel_size=2 is invalid with sas layers"),
    ({"num_attention_heads": 2, "num_query_groups": 2, "tensor_model_parallel_size": 2},
     "allowed a divisor of the attention heads per tensor-parallel rank"),
    ({"num_attention_heads": 6, "num_query_groups": 3, "kv_channels": 16},
     "num_query_groups=3 per tensor-parallel rank 3: allowed a divisor or a multiple"),
    ({"context_parallel_scheme": "ring"}, "context_parallel_scheme='ring' is invalid"),
    ({"context_parallel_scheme": "state_passing"},
     "no layer's variant takes state passing (those that do: ['approx', 'asa', 'nonapprox'])"),
], ids=["sas", "qk-source", "mixed-pattern", "hybrid-mamba-heads", "hybrid-mamba-groups",
        "hybrid-sas", "heads", "kv-heads", "scheme", "no-state-passing"])
def test_config_refuses_what_has_no_cp_path(kwargs, needle):
    with pytest.raises(ValueError) as err:
        SubqTransformerConfig(**{**TINY, **kwargs, "context_parallel_size": 2})
    assert needle in str(err.value), str(err.value)


MIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.mark.parametrize("extra,world,needle", [
    (["--seq-length", "30"], 2, "--context-parallel-size=2 needs --seq-length=30 divisible by 2 "
                                "x --context-parallel-size = 4"),
    (["--reset-attention-mask"], 2, "--reset-attention-mask (packed documents) with "
                                    "--context-parallel-size=2 is not supported"),
    ([], 3, "--context-parallel-size=2 does not divide the world size 3"),
], ids=["seq-length", "packed", "world"])
def test_trainer_flags_refuse_bad_cp(capsys, extra, world, needle):
    with pytest.raises(SystemExit) as e:
        arguments.parse_args(MIN + ["--context-parallel-size", "2"] + extra, world_size=world)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_trainer_names_the_flag_for_a_variant_without_cp(capsys):
    from megatron_subq.training.trainer import build_config

    args = arguments.parse_args(MIN + ["--context-parallel-size", "2", "--attention-variant",
                                       "sas"], world_size=2)
    args.data_parallel_size = 1
    with pytest.raises(SystemExit):
        build_config(args)
    err = capsys.readouterr().err
    assert "--context-parallel-size" in err and "sas layers" in err, err


def test_trainer_names_the_flag_for_mamba_heads_cp_cannot_split(capsys):
    from megatron_subq.training.trainer import build_config

    args = arguments.parse_args(MIN + HYBRID_TRAINER + ["--context-parallel-size", "2",
                                                        "--mamba-num-heads", "3",
                                                        "--mamba-num-groups", "1"],
                                world_size=2)
    args.data_parallel_size = 1
    with pytest.raises(SystemExit):
        build_config(args)
    err = capsys.readouterr().err
    assert "--context-parallel-size" in err and "Mamba heads" in err, err


def test_capabilities():
    """The variants with an all-to-all path, and those refusing CP."""
    assert CP_VARIANTS == ["approx", "asa", "mlp", "nonapprox", "ppa", "standard", "superlinear"]
    refused = sorted(n for n, v in VARIANTS.items() if v.context_parallel == "none")
    assert refused == ["fixed_seq_qk", "rnd_emb_qk", "sas", "static_emb_qk"]
    assert sorted(n for n, v in VARIANTS.items() if v.state_passing) == ["approx", "asa",
                                                                         "nonapprox"]


def test_state_passing_is_a_trainer_flag():
    from megatron_subq.training.trainer import build_config

    args = arguments.parse_args(MIN + ["--context-parallel-size", "2", "--attention-variant",
                                       "asa", "--context-parallel-scheme", "state_passing"],
                                world_size=2)
    assert build_config(args).context_parallel_scheme == "state_passing"
