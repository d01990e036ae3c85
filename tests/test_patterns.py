"""Layer patterns: uniform, hybrid, the paper's Table 11 (for 24 layers and generalised), explicit
per-layer lists, and the skip ablation's layer specs."""

import pytest

import megatron_subq as subq
from megatron_subq.patterns import (
    NAMED_PATTERNS,
    TABLE11_STANDARD_LAYERS,
    resolve_layer_pattern,
    variant_layers,
)
from megatron_subq.specs import SkippedTransformerLayer

# deconstructing-attention, Appendix P, Table 11: "Standard Layer IDs" of the 24-layer model
TABLE11 = {
    "even": {2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24},
    "odd": {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23},
    "top": {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
    "middle": {1, 2, 3, 4, 5, 6, 19, 20, 21, 22, 23, 24},
    "bottom": {13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24},
    "25%": {4, 8, 12, 16, 20, 24},
    "first": {1},
    "last": {24},
    "bilateral": {1, 24},
}

SMALL = dict(num_layers=24, hidden_size=32, num_attention_heads=2)


def test_table11_for_24_layers():
    assert set(TABLE11_STANDARD_LAYERS) == set(TABLE11)
    for name, standard in TABLE11.items():
        assert TABLE11_STANDARD_LAYERS[name](24) == standard, name
        layers = resolve_layer_pattern(name, "nonapprox", 24)
        got_standard = {i + 1 for i, v in enumerate(layers) if v == "standard"}
        assert got_standard == standard, name
        assert {v for v in layers if v != "standard"} == {"nonapprox"}, name


def test_table11_through_the_config():
    for name, standard in TABLE11.items():
        cfg = subq.SubqTransformerConfig(**SMALL, attention_variant="approx", layer_pattern=name)
        assert [i + 1 for i, v in enumerate(cfg.layer_variants) if v == "standard"] == sorted(
            standard), name


def test_uniform_and_hybrid():
    assert resolve_layer_pattern(None, "mlp", 3) == ["mlp"] * 3
    assert resolve_layer_pattern("uniform", "mlp", 3) == ["mlp"] * 3
    assert resolve_layer_pattern("hybrid", "mlp", 5) == ["mlp", "standard", "mlp", "standard",
                                                         "mlp"]
    # the paper's main hybrid is Table 11's "even" (even layers stay standard)
    for n in range(1, 30):
        assert variant_layers("hybrid", n) == variant_layers("even", n)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 12, 13, 24, 25, 48])
def test_generalisation_to_any_depth(n):
    everything = set(range(1, n + 1))
    for name in NAMED_PATTERNS:
        chosen = variant_layers(name, n)
        assert chosen <= everything, name
    std = {name: fn(n) for name, fn in TABLE11_STANDARD_LAYERS.items()}
    assert std["even"] | std["odd"] == everything and not std["even"] & std["odd"]
    # top/bottom: the variant takes the upper/lower ceil(n/2) layers
    assert everything - std["top"] == set(range(n // 2 + 1, n + 1))
    assert everything - std["bottom"] == set(range(1, n - n // 2 + 1))
    # middle: floor(n/4) standard layers at each end
    assert len(std["middle"]) == 2 * (n // 4)
    assert std["25%"] == {i for i in everything if i % 4 == 0}
    assert std["first"] == {1} and std["last"] == {n} and std["bilateral"] == {1, n}
    # 48 layers: Table 11's blocks doubled
    if n == 48:
        assert std["middle"] == set(range(1, 13)) | set(range(37, 49))
        assert std["bottom"] == set(range(25, 49))


def test_explicit_lists_mix_variants():
    cfg = subq.SubqTransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2,
                                     layer_pattern=["mlp", "approx", "standard", "nonapprox"])
    assert cfg.layer_variants == ["mlp", "approx", "standard", "nonapprox"]


@pytest.mark.parametrize("bad,needle", [
    ("fifty", "layer_pattern"),
    (["mlp", "standard"], "num_layers=3"),
    (["mlp", "nope", "standard"], "layer_pattern\\[1\\]"),
])
def test_bad_patterns_name_the_field(bad, needle):
    with pytest.raises(ValueError, match=needle):
        subq.SubqTransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=2,
                                   attention_variant="mlp", layer_pattern=bad)


def test_skip_builds_pass_through_layers_for_the_variant_layers_only():
    for skip in (False, True):
        cfg = subq.SubqTransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=2,
                                         attention_variant="approx", layer_pattern="hybrid",
                                         skip_variant_layers=skip)
        modules = [subq.get_gpt_layer_spec(cfg, n, use_te=False).module for n in range(1, 5)]
        skipped = [m is SkippedTransformerLayer for m in modules]
        assert skipped == ([True, False, True, False] if skip else [False] * 4)
        # the skipped layers keep the variant's attention spec: same parameters, same checkpoint
        attn = subq.get_gpt_layer_spec(cfg, 1, use_te=False).submodules.self_attention
        assert attn.submodules.core_attention.__name__ == "ApproxCoreAttention"
