"""approx: deconstructing-attention's Taylor-form linear attention (Appendix I, Eq. 14-17).

Only the attention core changes: megatron's ``SelfAttention`` (fused QKV column-parallel
projection, RoPE, GQA, row-parallel output) with ``ApproxCoreAttention``, which calls
``ops.approx_attention`` on the raw projections (the op applies the d_h^{-1/4} pre-scaling).
RoPE is kept: the variant approximates ``softmax(QK^T/sqrt(d_h))`` of the standard layer, whose Q
and K are rotated; a per-position rotation of q and k leaves the linear-attention form intact.
No parameters of its own, no communication of its own: the recurrence runs along the sequence
inside one head, and TP shards heads.
"""

from __future__ import annotations

from ..attention import SubqCoreAttention
from ..ops import approx_attention
from .base import Variant
from .standard import self_attention_spec


class ApproxCoreAttention(SubqCoreAttention):
    """o = mean(v) + normalised linear attention (identity features) + (element-wise squares)."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        if self.softmax_scale is not None:
            raise ValueError(f"softmax_scale={self.softmax_scale!r} is invalid for approx: allowed "
                             "None (q and k are pre-scaled by kv_channels**-0.25)")

    def attend(self, q, k, v):
        return approx_attention(q, k, v, impl=self.config.subq_impl)


def attention_spec(config, layer_number: int, provider):
    return self_attention_spec(ApproxCoreAttention, provider)


def validate(config) -> None:
    if config.softmax_scale is not None:
        raise ValueError(f"softmax_scale={config.softmax_scale!r} is invalid with approx layers: "
                         "allowed None (q and k are pre-scaled by kv_channels**-0.25)")


def core_flops(config, L: int) -> float:
    """Mean of v, plus two normalised linear attentions (identity and squared features, dim D):
    state k (x) v (D x D) and readout per token, and their normalisers."""
    H, D = config.num_attention_heads, config.kv_channels
    return L * H * (D + 2 * (2 * D * D + 2 * D * D + 2 * 2 * D))


VARIANT = Variant(
    name="approx",
    summary="second-order Taylor linear attention, three separately normalised terms (Eq. 14-17)",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
    core_flops=core_flops,
    context_parallel="all_to_all",
)
