"""ppa: Power-based Partial Attention — a causal softmax over the window band plus power offsets.

Only the attention core changes: megatron's ``SelfAttention`` (fused QKV, RoPE, GQA, row-parallel
output) around ``PPACoreAttention``, which calls ``ops.ppa_attention`` with the config's
``ppa_power`` (p) and ``ppa_window`` (w). No parameters are added; under TP each rank attends with
its own heads, so there is no communication beyond megatron's projections.
"""

from __future__ import annotations

from ..attention import SubqCoreAttention
from ..ops.ppa import ppa_attention, ppa_power_fraction
from .base import Variant
from .standard import self_attention_spec


class PPACoreAttention(SubqCoreAttention):
    """Query i attends key k <= i iff i-k <= ppa_window or i-k in S_p (p = ppa_power)."""

    def attend(self, q, k, v, cu_seqlens=None):
        return ppa_attention(q, k, v, self.config.ppa_power, self.config.ppa_window,
                             impl=self.config.subq_impl, scale=self.softmax_scale,
                             cu_seqlens=cu_seqlens)

    def attend_packed(self, q, k, v, cu_seqlens):
        return self.attend(q, k, v, cu_seqlens=cu_seqlens)  # the op restarts at each boundary


def attention_spec(config, layer_number: int, provider):
    return self_attention_spec(PPACoreAttention, provider)


def validate(config) -> None:
    # config.py checks the range of ppa_power and ppa_window; offsets are exact only for a power
    # that is a rational with a small denominator, so refuse what would otherwise be rounded.
    ppa_power_fraction(config.ppa_power, what="ppa_power")


VARIANT = Variant(
    name="ppa",
    summary="power-based partial attention: window band + offsets where floor(j^p) increments",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
)
