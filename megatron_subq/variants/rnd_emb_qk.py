"""rnd_emb_qk (deconstructing-attention §3.4, "RndEmbQK"): Q, K from a fixed random input.

A fixed random input ε (``L × hidden``, ~ N(0, init_method_std²), drawn once from
``fixed_qk_seed``, never trained) runs through the same layers as the real input. At an
rnd_emb_qk layer, Q and K come from ε's hidden state there (through the layer's own input norm
and Q/K projection), V from the real input: one attention map ``softmax(q_ε k_εᵀ/√d_h)`` for the
whole batch. ε is carried as one extra batch row (``megatron_subq.model``); the map is applied
with ``ops.shared_map_attention``.
"""

from __future__ import annotations

from .base import Variant
from .qk_source import SharedMapCoreAttention, qk_source_attention_spec, validate_qk_source_config
from .standard import standard_core_flops


def attention_spec(config, layer_number: int, provider):
    return qk_source_attention_spec(SharedMapCoreAttention, provider)


def validate(config) -> None:
    seed = config.fixed_qk_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"fixed_qk_seed={seed!r} is invalid: allowed an integer in [0, 2**63)")
    validate_qk_source_config(config, "rnd_emb_qk")


VARIANT = Variant(
    name="rnd_emb_qk",
    summary="Q, K from a fixed random input run through the same layers (one map for the batch); "
            "V from the input",
    attention_spec=attention_spec,
    validate=validate,
    knobs=("fixed_qk_seed",),
    core_flops=standard_core_flops,  # + one pass of the fixed row (training/flops.py)
    fixed_input=True,
    hosts=("gpt",),  # the fixed row cannot pass through a hybrid host's Mamba mixers
)
