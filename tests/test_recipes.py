"""The 1.3B/100B and 1.5B/50B recipes, the run planner (tools/plan_run.py) and --silu.

Parameter counts below are computed by hand from each recipe's shape (not copied from the
planner); the planner's analytic counts are then compared with models built on the meta device.
"""

import contextlib
import io
import json
import os

import pytest

from megatron_subq.testing.distributed import run_distributed
from megatron_subq.testing.recipes import meta_parameter_counts
from megatron_subq.training import plan
from megatron_subq.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")
NEW_RECIPES = ("asa-1.3b-100b", "sas-1.3b-100b", "transformer-pp-1.3b-100b",
               "sas-1.5b-50b-fineweb")


def _recipe(name):
    return os.path.join(RECIPES, f"{name}.yaml")


# ---- parameter counts by hand -------------------------------------------------------------
def _asa_1_3b():
    h, L, H, D, F, V, m = 2048, 24, 4, 512, 8192, 32000, 64
    attention = h * 3 * H * D + H * D * h            # fused QKV (no GQA) + output projection
    mlp = h * F + F * h                               # non-gated SiLU: fc1, fc2
    asa = 2 * H * D * m                               # P_Q, P_K [H, D, m]
    norms = 2 * h
    return L * (attention + mlp + asa + norms) + 2 * V * h + h  # untied embeddings, final norm


def _transformer_pp_1_3b():
    h, L, F, V = 2048, 24, 5632, 32000
    attention = h * 3 * h + h * h                     # 16 x 128 = hidden
    mlp = h * 2 * F + F * h                           # SwiGLU: fc1 holds gate and up
    return L * (attention + mlp + 2 * h) + 2 * V * h + h


def _sas_extra(H, Hs, D, Ds, k):
    """SAS's expansions per layer: q and k (heads: Conv H->Hs, RCNN Hs->Hs; features: Lin D->Ds,
    RMLP Ds->Ds), v (heads only); no biases."""
    heads = Hs * H * k + Hs * Hs * k
    features = Ds * D + Ds * Ds
    return 2 * (heads + features) + heads


def _sas_1_3b():
    return _transformer_pp_1_3b() + 24 * _sas_extra(16, 48, 128, 192, 5)


def _sas_1_5b():
    h, L, H, D, F, V = 1600, 48, 25, 64, 4266, 50304  # GPT-2's 50257 padded to 128
    attention = h * 3 * H * D + H * D * h
    mlp = h * 2 * F + F * h
    per_layer = attention + mlp + 2 * h + _sas_extra(H, 75, D, 96, 5)
    return L * per_layer + V * h + h                  # tied embeddings


EXPECTED = {"asa-1.3b-100b": _asa_1_3b(), "transformer-pp-1.3b-100b": _transformer_pp_1_3b(),
            "sas-1.3b-100b": _sas_1_3b(), "sas-1.5b-50b-fineweb": _sas_1_5b()}


def test_hand_counts_are_the_papers_sizes():
    assert EXPECTED["asa-1.3b-100b"] == 1_345_423_360          # "1.3B" (gated at 8192: 1.75B)
    assert EXPECTED["transformer-pp-1.3b-100b"] == 1_364_297_728
    assert EXPECTED["sas-1.3b-100b"] == 1_368_352_768
    assert EXPECTED["sas-1.5b-50b-fineweb"] == 1_561_922_560    # "1.5B"


def _tiny(variant_flags, *extra):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", "32", "--micro-batch-size", "1",
            "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", *variant_flags, *extra]


def _tiny_cases():
    from megatron_subq.testing.cases import trainer_flags
    from megatron_subq.variants import VARIANTS

    cases = {name: _tiny(trainer_flags(name)) for name in sorted(VARIANTS)}
    odd = ["--normalization", "LayerNorm", "--add-bias-linear", "--position-embedding-type",
           "learned_absolute", "--max-position-embeddings", "48",
           "--no-untie-embeddings-and-output-weights", "--no-swiglu"]
    for name in ("standard", "sas", "superlinear", "asa", "mlp", "static_emb_qk"):
        qk_norm = ["--qk-layernorm"] if name not in ("mlp", "static_emb_qk") else []  # refused
        cases[f"{name}+bias,layernorm,learned,tied,gelu"] = _tiny(trainer_flags(name), *odd,
                                                                  *qk_norm)
    cases["standard+silu"] = _tiny(["--silu"])
    cases["tiny-hybrid"] = ["--config", os.path.join(RECIPES, "tiny-hybrid-cpu.yaml"),
                            "--vocab-size", "32000"]
    return cases


@pytest.fixture(scope="module")
def meta_counts():
    """Every new recipe and every variant (tiny, two shape sets) built on the meta device, in
    one one-rank world."""
    cases = {name: ["--config", _recipe(name)] for name in NEW_RECIPES}
    cases.update(_tiny_cases())
    cpu = [name.startswith("fixed_seq_qk") for name in cases]  # reads its token file's values
    counts = run_distributed(meta_parameter_counts, 1, args=(list(cases.values()), cpu))[0]
    return dict(zip(cases, counts)), cases


@pytest.mark.parametrize("name", NEW_RECIPES)
def test_recipe_parses_validates_and_builds_with_its_size(name, meta_counts):
    args = parse_args(["--config", _recipe(name)], world_size=8, check_files=False)
    assert args.bf16 and args.use_distributed_optimizer
    assert args.tensor_model_parallel_size == args.pipeline_model_parallel_size == 1
    assert args.save and args.load == args.save and args.save_interval and args.eval_interval
    counts, _ = meta_counts
    assert counts[name] == EXPECTED[name]


def test_recipe_token_budgets():
    """100B tokens through samples (warm-up 1B), 2M-token batches; SAS 1.5B: TPA's 100K steps of
    480 x 1024."""
    for name in ("asa-1.3b-100b", "sas-1.3b-100b", "transformer-pp-1.3b-100b"):
        a = parse_args(["--config", _recipe(name)], world_size=8, check_files=False)
        assert a.global_batch_size * a.seq_length == 2_097_152
        assert a.train_samples * a.seq_length == 100_000_000_000
        assert abs(a.lr_warmup_samples * a.seq_length - 1e9) < a.seq_length
        assert (a.lr, a.min_lr, a.lr_warmup_init, a.weight_decay) == (3e-4, 3e-5, 3e-5, 0.01)
    a = parse_args(["--config", _recipe("sas-1.5b-50b-fineweb")], world_size=8,
                   check_files=False)
    assert a.train_iters * a.global_batch_size * a.seq_length == 49_152_000_000
    assert a.tokenizer_type == "HuggingFaceTokenizer" and a.vocab_size == 50257


def test_planner_counts_equal_the_built_models(meta_counts):
    counts, cases = meta_counts
    for name, argv in cases.items():
        args, cfg, _ = plan.resolve(argv, world_size=1)
        from megatron_subq.training.tokenizer import padded_vocab_size
        vocab = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
        assert plan.parameter_count(args, cfg, vocab)[0] == counts[name], name


def test_planner_counts_nemotron_nano_total_and_active():
    """The published size that tests/test_hybrid.py builds on the meta device."""
    p = plan.plan_run(_recipe("nemotron-3-nano-30b-a3b"), nodes=4, ep=8, extra=[
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "131072",
        "--train-iters", "1000", "--moe-token-dispatcher-type", "allgather",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "32",
        "--use-distributed-optimizer"])
    assert (p.params, p.active_params) == (31_577_937_344, 3_580_073_408)


# ---- memory by hand ---------------------------------------------------------------------------
def test_plan_memory_matches_hand_arithmetic(capsys):
    """Transformer++ 1.3B on 4 nodes x 8 H100: TP 1, PP 1, DP 32, micro-batch 8, no recompute."""
    from tools.plan_run import main

    assert main(["--config", _recipe("transformer-pp-1.3b-100b"), "--nodes", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    P = 1_364_297_728
    s, b, h, L, F, V, dp = 2048, 8, 2048, 24, 5632, 32000, 32
    GiB = 1024 ** 3
    expected = {
        "parameters": 2 * P / GiB,                     # bf16 weights
        "gradients": 4 * P / GiB,                      # fp32 gradient buffers
        "optimizer": 12 * P / dp / GiB,                # fp32 main + m + v, split over DP 32
        # per token and layer: inputs of the 2 norms, of QKV, of fc1 (4h); q, k, v (3h), core
        # output = projection input (h); SwiGLU fc1 output (2F) and activation output (F)
        "activations": 2 * s * b * L * (4 * h + 3 * h + h + 3 * F) / GiB,
        # last stage: output-layer input (2sbh) + bf16 logits and fp32 softmax (6sbV)
        "logits": (2 * s * b * h + 6 * s * b * V) / GiB,
        "runtime reserve": 4.0,
    }
    # backward's temporaries: the measured 55% of activations + logits (plan.TRANSIENT_FACTOR)
    expected["transients"] = 0.55 * (expected["activations"] + expected["logits"])
    assert out["memory_gib"] == pytest.approx(expected, rel=1e-12)
    assert out["memory_gib"]["activations"] == pytest.approx(24.375, abs=1e-3)
    assert out["memory_total_without_distributed_optimizer_gib"] == pytest.approx(
        sum(expected.values()) - expected["optimizer"] + 12 * P / GiB)
    assert out["parameters"] == P and out["iterations"] == 47_683
    assert out["tokens_per_iteration"] == 2_097_152
    assert out["layout"] == {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 32,
                             "sequence_parallel": False, "micro_batch_size": 8,
                             "global_batch_size": 1024, "micro_batches_per_iteration": 4,
                             "distributed_optimizer": True, "recompute": "none"}


def test_plan_text_output_names_the_lines_that_matter(capsys):
    from tools.plan_run import main

    assert main(["--config", _recipe("asa-1.3b-100b"), "--nodes", "2"]) == 0
    text = capsys.readouterr().out
    for fragment in ("parameters   1,345,423,360", "TP 1 x PP 1 x CP 1 x DP 16",
                     "2,097,152 per iteration x 47,683 iterations", "checks: ok",
                     "MLP silu 8192", "recompute selective"):
        assert fragment in text, fragment


# ---- bad layouts ----------------------------------------------------------------------------
@pytest.mark.parametrize("flags, fragments", [
    (["--nodes", "1", "--tp", "3"],
     ["--tp (--tensor-model-parallel-size) 3 does not divide --num-attention-heads 16",
      "--ffn-hidden-size 5632", "the world of 8 GPUs", "is not divisible by --tp 3"]),
    (["--nodes", "2", "--pp", "5"],
     ["--pp (--pipeline-model-parallel-size) 5 does not divide --num-layers 24"]),
    (["--nodes", "3"],
     ["--global-batch-size 1024 is not divisible by --micro-batch-size 8 x data-parallel size 24"]),
    (["--nodes", "1", "--cp", "3"],
     ["--seq-length 2048 is not divisible by 2 x --cp 3", "is not divisible by --tp 1 x --pp 1 "
      "x --cp 3"]),
    (["--nodes", "1", "--cp", "2", "--attention-variant", "sas"],
     ["--cp (--context-parallel-size) 2: variant(s) sas have no context-parallel path"]),
    (["--nodes", "1", "--micro-batch-size", "64", "--no-use-distributed-optimizer",
      "--no-overlap-param-gather"],
     ["memory: ", "exceeds the H100's 79.1 GiB", "--micro-batch-size 64",
      "--use-distributed-optimizer"]),
])
def test_bad_layouts_are_reported_naming_the_flag(flags, fragments, capsys):
    from tools.plan_run import main

    assert main(["--config", _recipe("transformer-pp-1.3b-100b"), *flags]) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def test_a_trainer_error_is_reported_not_exited(capsys):
    from tools.plan_run import main

    assert main(["--config", _recipe("asa-1.3b-100b"), "--nodes", "1",
                 "--asa-rank", "512"]) == 2
    assert "--asa-rank" in capsys.readouterr().err


# ---- throughput --------------------------------------------------------------------------------
def test_missing_throughput_row_is_said_plainly():
    p = plan.plan_run(_recipe("sas-1.3b-100b"), nodes=4, gpu="H200")  # measured on H100 only
    assert p.seconds is None
    assert p.time_note.startswith("no measured throughput for sas-1.3b-100b (variant sas) on "
                                  "H200")
    assert p.time_note.endswith("time not estimated")


def test_time_from_a_measured_row_with_the_stated_efficiency(tmp_path):
    table = tmp_path / "throughput.yaml"
    table.write_text("rows:\n- {gpu: H100, recipe: transformer-pp-1.3b-100b, "
                     "attention_variant: standard, tokens_per_s_per_gpu: 20000, gpus: 8, tp: 1, "
                     "pp: 1, micro_batch_size: 8, date: 2026-11-25, command: x}\n")
    p = plan.plan_run(_recipe("transformer-pp-1.3b-100b"), nodes=4, throughput_file=str(table))
    tokens = 47_683 * 1024 * 2048
    assert p.scaling_efficiency == plan.DEFAULT_SCALING_EFFICIENCY  # 32 GPUs > 8 measured
    assert p.seconds == pytest.approx(tokens / (20000 * 32 * 0.9))
    assert "scaling efficiency 0.90" in p.time_note and "assumed" in p.time_note
    p = plan.plan_run(_recipe("transformer-pp-1.3b-100b"), nodes=1, throughput_file=str(table),
                      micro_batch_size=4)
    assert p.scaling_efficiency == 1.0 and "another layout" in p.time_note
    assert p.seconds == pytest.approx(tokens / (20000 * 8))
    with pytest.raises(plan.PlanError, match="--gpu B300 is unknown"):
        plan.plan_run(_recipe("transformer-pp-1.3b-100b"), nodes=1, gpu="B300")


# ---- --silu ----------------------------------------------------------------------------------
def test_silu_flag_is_a_non_gated_silu_mlp():
    import torch.nn.functional as F

    from megatron_subq.training.flops import forward_flops_per_sequence
    from megatron_subq.training.trainer import build_config

    base = _tiny([])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = parse_args(base + ["--silu"], world_size=1)
    assert "--silu: switching --swiglu off" in out.getvalue()
    assert args.swiglu is False and args.ffn_hidden_size == 4 * 64  # Megatron's non-gated default
    cfg = build_config(args)
    assert cfg.activation_func is F.silu and cfg.gated_linear_unit is False
    gated = build_config(parse_args(base + ["--ffn-hidden-size", "256"], world_size=1))
    L = 32
    mlp_difference = 2.0 * L * 64 * 256  # one fewer h x F matrix per layer
    assert forward_flops_per_sequence(gated, L, 128) - forward_flops_per_sequence(cfg, L, 128) \
        == pytest.approx(2 * mlp_difference)
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            parse_args(base + ["--silu", "--squared-relu"], world_size=1)
    assert "--squared-relu conflicts with --silu" in err.getvalue()
    from megatron_subq.training.checkpointing import MODEL_SHAPE_ARGS
    assert "silu" in MODEL_SHAPE_ARGS


def test_vocab_size_is_checked_against_a_real_tokenizer(capsys):
    """A recipe's --vocab-size states its tokenizer; a different tokenizer file stops the run
    before the model is built."""
    pytest.importorskip("mistral_common")
    from megatron_subq.training import pretrain

    with pytest.raises(SystemExit) as e:
        pretrain(_tiny([])[:-4] + ["--tokenizer-type", "GPTSentencePieceTokenizer",
                                   "--tokenizer-model", "mistral",
                                   "--vocab-size", "50257", "--num-workers", "0",
                                   "--eval-iters", "0"])
    assert e.value.code == 2
    assert ("--vocab-size 50257: the tokenizer --tokenizer-model mistral has 32000 tokens"
            in capsys.readouterr().err)


def test_trainer_refuses_an_ffn_width_tp_does_not_split(capsys):
    with pytest.raises(SystemExit):
        parse_args(_tiny([], "--ffn-hidden-size", "101", "--tensor-model-parallel-size", "2",
                         "--num-query-groups", "2"), world_size=2)
    assert ("--ffn-hidden-size=101 is not divisible by --tensor-model-parallel-size=2"
            in capsys.readouterr().err)


def test_a_command_line_data_source_replaces_the_recipes():
    """--config RECIPE --mock-data (or --data-path X) tries a recipe without its data: the file's
    data source gives way instead of conflicting; any other flag still overrides one by one."""
    from megatron_subq.training import arguments

    args = arguments.parse_args(["--config", _recipe("asa-1.3b-100b"), "--mock-data",
                                 "--tokenizer-type", "NullTokenizer"], world_size=8)
    assert args.mock_data and not args.data_path and args.data_args_path is None
    assert args.seq_length == 2048 and args.attention_variant == "asa"
    with pytest.raises(SystemExit):  # without the override the recipe's blend file must exist
        arguments.parse_args(["--config", _recipe("asa-1.3b-100b"), "--tokenizer-type",
                              "NullTokenizer", "--vocab-size", "32000"], world_size=8)


def test_context_parallelism_splits_the_sequence_and_the_optimizer():
    """--cp 2 on 8 GPUs: DP 4, each rank holds half of every sequence's activations and logits,
    and the distributed optimizer shards over DP x CP = 8 as at DP 8 without CP."""
    one = plan.plan_run(_recipe("transformer-pp-1.3b-100b"), nodes=1, micro_batch_size=4)
    two = plan.plan_run(_recipe("transformer-pp-1.3b-100b"), nodes=1, micro_batch_size=4, cp=2)
    assert two.args.context_parallel_size == 2 and two.args.data_parallel_size == 4
    for key in ("activations", "logits", "transients"):
        assert two.memory[key] == pytest.approx(one.memory[key] / 2)
    for key in ("parameters", "gradients", "optimizer"):
        assert two.memory[key] == pytest.approx(one.memory[key])
    assert two.to_dict()["layout"]["cp"] == 2


def test_hybrid_context_parallelism_is_planned_and_mamba_heads_are_checked(capsys):
    """The hybrid host takes --cp (its Mamba-2 layers split heads over CP): Nemotron-3 Nano at
    --cp 2 plans; --cp 3 is refused for its 64 Mamba heads, naming the flag."""
    from tools.plan_run import main

    cpu = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "131072",
           "--train-iters", "1000", "--moe-token-dispatcher-type", "allgather",
           "--global-batch-size", "32", "--use-distributed-optimizer"]
    two = plan.plan_run(_recipe("nemotron-3-nano-30b-a3b"), nodes=4, ep=8, cp=2, extra=cpu)
    assert two.args.context_parallel_size == 2
    assert main(["--config", _recipe("nemotron-3-nano-30b-a3b"), "--nodes", "3", "--cp", "3",
                 *cpu]) == 2
    text = "".join(capsys.readouterr())
    assert "--cp (--context-parallel-size) 3: the Mamba-2 layers need the Mamba heads per TP " \
           "rank (64) divisible by it" in text, text
