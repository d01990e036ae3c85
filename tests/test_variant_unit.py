"""A variant is one self-describing unit (megatron_subq.variants.base.Variant).

* every registered variant declares its capabilities, its FLOPs and its tiny test settings;
* the registry refuses a duplicate name;
* the mlp variant's parameter-matched default width splits over the TP size, and a checkpoint is
  compared by the width it holds (the default depends on TP);
* a throwaway variant added through docs/architecture.md's recipe alone (its op, its variant
  file, one registry call, one test-settings entry) trains 2 steps with the project's trainer.
"""

import os
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq import SubqTransformerConfig  # noqa: E402
from megatron_subq.testing.cases import VARIANT_TEST_SETTINGS, trainer_flags  # noqa: E402
from megatron_subq.variants import (VARIANTS, register_variant,  # noqa: E402
                                    unregister_variant)
from megatron_subq.variants.base import CONTEXT_PARALLEL_MODES, HOSTS  # noqa: E402

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


def test_every_registered_variant_has_test_settings():
    missing = sorted(set(VARIANTS) - set(VARIANT_TEST_SETTINGS))
    assert not missing, f"add {missing} to megatron_subq/testing/cases.py: VARIANT_TEST_SETTINGS"
    assert sorted(VARIANT_TEST_SETTINGS) == sorted(VARIANTS)


def test_every_variant_declares_its_capabilities():
    for name, v in VARIANTS.items():
        assert v.name == name and v.summary
        assert v.context_parallel in CONTEXT_PARALLEL_MODES, name
        assert v.hosts and set(v.hosts) <= set(HOSTS), name
        assert v.core_flops is not None, f"{name}: no FLOPs formula"
        config = SubqTransformerConfig(**TINY, **{k: val for k, val in VARIANT_TEST_SETTINGS[
            name].items() if k != "layer_pattern"}, attention_variant=name)
        assert v.core_flops(config, 16) >= 0, name
        # the GPT host: no variant has HF modeling code there (superlinear's hybrid-host map,
        # linear_qs <-> mixer.qs_proj: tests/test_convert_superlinear_hf.py)
        assert v.hf_param_map(config) == {}, name
    # the Q/K-source variants' stream rows cannot pass through a hybrid host's Mamba mixers
    for name in ("rnd_emb_qk", "fixed_seq_qk", "static_emb_qk"):
        assert VARIANTS[name].hosts == ("gpt",), name
    assert [n for n, v in VARIANTS.items() if v.fixed_input] == ["rnd_emb_qk", "fixed_seq_qk"]
    assert [n for n, v in VARIANTS.items() if v.qk_from_embeddings] == ["static_emb_qk"]


def test_bad_capability_values_are_refused():
    from megatron_subq.variants.base import Variant

    with pytest.raises(ValueError, match="context_parallel='ring' is invalid: allowed one of"):
        Variant(name="x", summary="x", attention_spec=None, context_parallel="ring")
    with pytest.raises(ValueError, match=r"hosts=\('mamba',\) is invalid"):
        Variant(name="x", summary="x", attention_spec=None, hosts=("mamba",))


def test_register_variant_refuses_a_taken_name():
    with pytest.raises(ValueError, match="variant name 'asa' is invalid: already registered"):
        register_variant(VARIANTS["asa"])
    with pytest.raises(TypeError, match="allowed a megatron_subq Variant"):
        register_variant("asa")


def test_unused_variant_knob_still_fails():
    """A variant's own knob ranges are checked whether or not a layer uses it."""
    with pytest.raises(ValueError, match=r"ppa_power=2\.0 is invalid: allowed a number in \[0, 1"):
        SubqTransformerConfig(**TINY, ppa_power=2.0)


# ---- mlp: the default width splits over TP; checkpoints compare the width in use -------------
def test_mlp_default_width_is_a_multiple_of_the_tp_size():
    from megatron_subq.variants.mlp import matched_width

    # hidden 64, MHA: attention 4 d^2 = 16384 weights, f* = 85.3; 88 is 3% off, so not a
    # multiple of 8: 85 at TP=1, 86 at TP=2 (85 would not split), 84 at TP=4
    widths = {tp: matched_width(SubqTransformerConfig(**TINY, attention_variant="mlp",
                                                      tensor_model_parallel_size=tp))
              for tp in (1, 2, 4)}
    assert widths == {1: 85, 2: 86, 4: 84}
    # within tolerance, the multiple of 8 stays the default at every TP that divides it
    paper = dict(num_layers=1, hidden_size=896, num_attention_heads=14, attention_variant="mlp")
    assert {matched_width(SubqTransformerConfig(**paper, tensor_model_parallel_size=tp))
            for tp in (1, 2)} == {1192}
    # an explicit width that does not split is still refused, naming the field
    with pytest.raises(ValueError, match="mlp_attention_width=85 is invalid: allowed a multiple "
                                         "of tensor_model_parallel_size=2"):
        SubqTransformerConfig(**TINY, attention_variant="mlp", tensor_model_parallel_size=2,
                              mlp_attention_width=85)


def test_checkpoint_compares_the_mlp_width_in_use():
    from megatron_subq.training import arguments
    from megatron_subq.training.checkpointing import _saved_args, model_mismatches
    from test_trainer import MIN

    mlp = ["--attention-variant", "mlp"]
    saved = _saved_args(arguments.parse_args(MIN + mlp, world_size=1))  # TP=1: width 85
    at_tp2 = arguments.parse_args(MIN + mlp + ["--tensor-model-parallel-size", "2"], world_size=2)
    [found] = model_mismatches(saved, at_tp2)
    assert found.startswith("--mlp-attention-width: checkpoint 85 (in use; given None), this run "
                            "86 (given None)"), found
    assert "pass --mlp-attention-width 85" in found
    # the same width given explicitly is the same model
    explicit = arguments.parse_args(MIN + mlp + ["--mlp-attention-width", "85"], world_size=1)
    assert model_mismatches(saved, explicit) == []


# ---- a throwaway variant through the recipe alone ---------------------------------------------
OP = '''
import torch


def mean_v_attention(q, k, v):
    """Causal mean of the values: o_i = mean_{j <= i} v_j (q, k unused). [B, T, H, D] layout."""
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)  # GQA: query head h -> group
    steps = torch.arange(1, v.shape[1] + 1, device=v.device, dtype=v.dtype).view(1, -1, 1, 1)
    return v.cumsum(dim=1) / steps
'''

VARIANT_FILE = '''
from megatron_subq.attention import SubqCoreAttention
from megatron_subq.variants.base import Variant
from megatron_subq.variants.standard import self_attention_spec

from throwaway_op import mean_v_attention


class MeanVCoreAttention(SubqCoreAttention):
    def attend(self, q, k, v):
        return mean_v_attention(q, k, v)


def attention_spec(config, layer_number, provider):
    return self_attention_spec(MeanVCoreAttention, provider)


def core_flops(config, L):
    return 2.0 * L * config.num_attention_heads * config.kv_channels  # running sum, division


VARIANT = Variant(name="throwaway_mean_v", summary="causal mean of the values (a test variant)",
                  attention_spec=attention_spec, core_flops=core_flops, packed_sequences=True)
'''


def test_throwaway_variant_trains_two_steps(tmp_path, capsys):
    import importlib

    from megatron_subq.training import flops, pretrain
    from test_trainer import MIN

    (tmp_path / "throwaway_op.py").write_text(textwrap.dedent(OP))           # its op
    (tmp_path / "throwaway_variant.py").write_text(textwrap.dedent(VARIANT_FILE))  # its file
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("throwaway_variant")
        register_variant(module.VARIANT)                                    # the registry line
        VARIANT_TEST_SETTINGS["throwaway_mean_v"] = {}                      # its test settings
        config = SubqTransformerConfig(**TINY, attention_variant="throwaway_mean_v")
        assert flops.unmodelled_variants(config) == []
        summary = pretrain(MIN[:10] + ["--train-iters", "2"] + MIN[12:] + [
            "--global-batch-size", "2", "--num-workers", "0", "--eval-iters", "0"]
            + trainer_flags("throwaway_mean_v"))
        losses = summary["iterations"]
        assert sorted(losses) == [1, 2] and all(0 < x < 20 for x in losses.values()), losses
        assert "throwaway_mean_v" in capsys.readouterr().out
    finally:
        VARIANT_TEST_SETTINGS.pop("throwaway_mean_v", None)
        if "throwaway_mean_v" in VARIANTS:
            unregister_variant("throwaway_mean_v")
        sys.path.remove(str(tmp_path))
        for name in ("throwaway_variant", "throwaway_op"):
            sys.modules.pop(name, None)
    assert "throwaway_mean_v" not in VARIANTS
    with pytest.raises(KeyError):
        unregister_variant("throwaway_mean_v")
