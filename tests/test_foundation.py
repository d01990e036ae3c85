"""The foundation: config validation, registry, specs, the standard op, checkpoints, training."""

import os
import re
import subprocess
import sys

import pytest
import torch

import megatron_subq as subq
from megatron_subq.testing import run_distributed
from megatron_subq.testing.cases import variant_test_settings
from megatron_subq.testing.checkpoint import assert_resharded, reshard_tp2_tp1_tp2

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_public_api():
    assert "standard" in subq.VARIANTS
    for name, v in subq.VARIANTS.items():
        assert v.name == name and v.summary
    cfg = subq.SubqTransformerConfig(**BASE)
    assert cfg.layer_variants == ["standard", "standard"]
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    block = subq.get_gpt_block_spec(cfg, use_te=False)
    assert len(block.layer_specs) == 2


@pytest.mark.parametrize("field,value,needle", [
    ("attention_variant", "nope", "attention_variant='nope'"),
    ("layer_pattern", "zigzag", "layer_pattern='zigzag'"),
    ("layer_pattern", ["standard"], "layer_pattern has 1 entries"),
    ("layer_pattern", ["standard", "nope"], "layer_pattern[1]='nope'"),
    ("subq_impl", "fast", "subq_impl='fast'"),
    ("asa_normalize", "l2", "asa_normalize='l2'"),
    ("asa_rank", 0, "asa_rank=0"),
    ("ppa_power", 1.5, "ppa_power=1.5"),
    ("ppa_power", -0.1, "ppa_power=-0.1"),
    ("ppa_window", -1, "ppa_window=-1"),
    ("sas_kernel", 2, "sas_kernel=2"),
    ("superlinear_topk", 0, "superlinear_topk=0"),
    ("superlinear_search_power", 0.0, "superlinear_search_power=0.0"),
    ("superlinear_span_power", 0.25, "superlinear_span_power=0.25"),
    ("superlinear_backward_factor", 1.0, "superlinear_backward_factor=1.0"),
])
def test_invalid_config_names_the_field(field, value, needle):
    with pytest.raises(ValueError) as err:
        subq.SubqTransformerConfig(**BASE, **{field: value})
    assert needle in str(err.value), str(err.value)
    assert "allowed" in str(err.value)


def test_heads_not_divisible_by_tp_is_rejected():
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        subq.SubqTransformerConfig(**BASE, tensor_model_parallel_size=3)


def test_random_access_opt_out():
    cfg = subq.SubqTransformerConfig(**BASE, superlinear_span_power=0.25,
                                     superlinear_allow_no_random_access=True)
    assert cfg.superlinear_span_power == 0.25
    assert subq.SubqTransformerConfig(**BASE).superlinear_window == 1088


def test_build_gpt_model_rejects_bad_arguments():
    cfg = subq.SubqTransformerConfig(**BASE)
    with pytest.raises(ValueError, match="vocab_size"):
        subq.build_gpt_model(cfg, vocab_size=0, max_sequence_length=16)
    with pytest.raises(TypeError, match="SubqTransformerConfig"):
        subq.get_gpt_block_spec(object())
    with pytest.raises(ValueError, match="layer_number"):
        subq.get_gpt_layer_spec(cfg, 3)


@pytest.mark.parametrize("T,H,H_kv", [(1, 4, 4), (17, 4, 2), (33, 6, 1)])
def test_standard_op_matches_reference(T, H, H_kv):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, T, H, 8, generator=g)
    k = torch.randn(2, T, H_kv, 8, generator=g)
    v = torch.randn(2, T, H_kv, 8, generator=g)
    out = subq.ops.standard_attention(q, k, v)
    ref = subq.ops.standard_attention(q, k, v, impl="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # causality: changing the last token changes nothing before it
    k2 = k.clone(); k2[:, -1] += 1.0
    out2 = subq.ops.standard_attention(q, k2, v)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])


def test_standard_op_rejects_bad_input():
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="k must have shape"):
        subq.ops.standard_attention(q, torch.randn(4, 4, 8), q)
    with pytest.raises(ValueError, match="multiple of the key/value head count"):
        subq.ops.standard_attention(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))
    with pytest.raises(ValueError, match="impl="):
        subq.ops.standard_attention(q, q, q, impl="fast")


def test_te_spec_path():
    from megatron_subq.specs import HAVE_TE
    if not HAVE_TE:
        pytest.skip("transformer_engine is not importable here: the TE spec path is tested where "
                    "TE is installed")
    cfg = subq.SubqTransformerConfig(**BASE)
    spec = subq.get_gpt_layer_spec(cfg, 1, use_te=True)
    assert spec.submodules.input_layernorm.__name__ == "TENorm"


def test_attention_slot_spec_fills_the_gpt_layers_slot():
    """The host-agnostic slot builder gives each layer its variant's spec, from megatron's spec
    provider protocol; the GPT layer puts exactly that in its self_attention slot."""
    from megatron.core.models.backends import LocalSpecProvider

    cfg = subq.SubqTransformerConfig(**{**BASE, "layer_pattern": ["asa", "standard"]})
    provider = subq.get_spec_provider(use_te=False)
    assert isinstance(provider, LocalSpecProvider)
    assert provider.layer_norm(rms_norm=True).__name__ == "LocalNorm"
    slots = [subq.attention_slot_spec(cfg, n, provider) for n in (1, 2)]
    assert slots[0].submodules.core_attention.__name__ == "ASACoreAttention"
    assert slots[1].submodules.core_attention is provider.core_attention()
    for n, slot in enumerate(slots, start=1):
        assert subq.get_gpt_layer_spec(cfg, n, use_te=False).submodules.self_attention == slot
    with pytest.raises(ValueError, match="layer_number=3"):
        subq.attention_slot_spec(cfg, 3, provider)


def test_use_te_without_te_is_a_clear_error():
    from megatron_subq.specs import HAVE_TE
    if HAVE_TE:
        pytest.skip("transformer_engine is installed")
    with pytest.raises(ValueError, match="use_te=True"):
        subq.get_gpt_layer_spec(subq.SubqTransformerConfig(**BASE), 1, use_te=True)


def _roundtrip_cases():
    """A hybrid (two different layer specs) when a second variant is registered."""
    cases = [("standard", {})]
    others = [n for n in sorted(subq.VARIANTS) if n != "standard"]
    if others:
        cases.append(("hybrid", {**variant_test_settings(others[0]),
                                 "layer_pattern": [others[0], "standard"]}))
    return cases


@pytest.mark.parametrize("name,kwargs", _roundtrip_cases(), ids=lambda c: str(c)[:12])
def test_dist_checkpoint_reshards_between_tp2_and_tp1(tmp_path, name, kwargs):
    """Saved at TP=2, loaded at TP=1 and the other way: a hybrid (non-homogeneous layers) too."""
    assert_resharded(run_distributed(reshard_tp2_tp1_tp2, 2, tp=2, args=(kwargs, str(tmp_path))))


def test_quickstart_trains_with_falling_loss():
    """The README's main job: a tiny GPT trained with megatron's DDP + optimizer on the CPU."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"),
                          "--steps", "30"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # "held-out loss A at step 0 -> B at step 10 -> C at step 30"
    words = out.stdout.strip().splitlines()[-1].split()
    first, early, last = (float(words[i]) for i in (2, 7, 12))
    assert last < early < first - 0.5, out.stdout


def test_integer_root_is_exact_for_huge_arguments():
    """floor(x^p) stays exact (and fast) where floats cannot: 2^1000-sized powers, b up to 1000."""
    from megatron_subq.kernels.powers import floor_power, integer_root

    for b in (2, 3, 7, 1000):
        for r in (3, 10**20 + 7, 2**333 + 1):
            for n in (r**b - 1, r**b, r**b + 1):
                x = integer_root(n, b)
                assert x**b <= n < (x + 1) ** b
    assert floor_power(10**5, 999 / 1000) == 98855  # 10^(4.995) = 98855.3
    assert floor_power(1000, 1 / 3) == 10 and floor_power(9, 0.5) == 3 and floor_power(8, 0.5) == 2


def test_source_checkout_finds_the_kernels(tmp_path):
    """Run from a checkout that is not installed (the examples put the repository root first on
    sys.path), ``megatron_subq.kernels`` must still resolve — to that checkout's ``kernels/`` — or
    the ops silently run their references on CUDA. ``-S`` skips site's .pth files, so no
    installed or editable copy of the project can answer instead."""
    import site
    import sysconfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("megatron_subq", "kernels"):
        os.symlink(os.path.join(root, name), checkout / name)
    paths = [str(checkout), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
             *site.getsitepackages()]
    code = ("import sys; sys.path[:0] = sys.argv[1:]; import megatron_subq.kernels.asa as a; "
            "print(a.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code, *paths], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(checkout / "kernels" / "asa" / "__init__.py")


def test_reference_on_cuda_is_announced_once():
    """CUDA inputs that end up on an op's PyTorch reference (no kernel importable, or sizes the
    kernel does not cover) say so once per op: a silent fallback only shows as slow training."""
    import warnings

    from megatron_subq.ops import dispatch

    class CudaLike:  # choose_impl only asks where a tensor lives
        is_cuda = True

    dispatch._WARNED_OPS.discard("some_op")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert dispatch.choose_impl("some_op", None, [CudaLike()], None) == "reference"
        assert dispatch.choose_impl("some_op", "reference", [CudaLike()], None) == "reference"
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and messages[0].startswith("some_op: no Triton kernel")


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_local_norm_keeps_float64(kind):
    """The norm computes in the wider of float32 and the input's dtype (float64 stays exact)."""
    from megatron_subq.norm import LocalNorm

    config = subq.SubqTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                        normalization=kind, params_dtype=torch.float64)
    norm = LocalNorm(config, 8, eps=1e-6)
    x = torch.randn(3, 8, dtype=torch.float64) * 1e3 + 1.0 / 3
    y = norm(x)
    assert y.dtype == torch.float64
    if kind == "RMSNorm":
        ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    else:
        c = x - x.mean(-1, keepdim=True)
        ref = c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(y, ref, rtol=1e-12, atol=1e-12)


def test_every_variant_knob_is_read():
    """A knob the config validates but no module reads is a promise the model does not keep."""
    import megatron_subq
    from megatron_subq.training.arguments import variant_fields

    package = os.path.dirname(megatron_subq.__file__)
    sources = []
    for folder, _, files in os.walk(package):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(package, "config.py") and \
                    os.sep + "training" + os.sep not in path:
                sources.append(open(path, encoding="utf-8").read())
    text = "\n".join(sources)
    config_only = {  # knobs that steer config.py's own checks, not the model
        "superlinear_allow_no_random_access": "opts out of the random-context-access check"}
    unread = [f.name for f in variant_fields()
              if f.name not in ("attention_variant", "layer_pattern", *config_only)
              and not re.search(r"\b" + f.name + r"\b", text)]
    assert not unread, f"validated but never read outside config.py: {unread}"
