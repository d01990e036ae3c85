"""ppa: Power-based Partial Attention — a causal softmax over the window band plus power offsets.

Only the attention core changes: megatron's ``SelfAttention`` (fused QKV, RoPE, GQA, row-parallel
output) around ``PPACoreAttention``, which calls ``ops.ppa_attention`` with the config's
``ppa_power`` (p) and ``ppa_window`` (w). No parameters are added; under TP each rank attends with
its own heads, so there is no communication beyond megatron's projections.
"""

from __future__ import annotations

import numpy as np

from ..attention import KVCache, SubqCoreAttention
from ..ops.ppa import ppa_attention, ppa_offsets, ppa_power_fraction, ppa_prefill
from .base import Variant, knob_error
from .standard import self_attention_spec


class PPACoreAttention(SubqCoreAttention):
    """Query i attends key k <= i iff i-k <= ppa_window or i-k in S_p (p = ppa_power)."""

    def attend(self, q, k, v, cu_seqlens=None):
        return ppa_attention(q, k, v, self.config.ppa_power, self.config.ppa_window,
                             impl=self.config.subq_impl, scale=self.softmax_scale,
                             cu_seqlens=cu_seqlens)

    def attend_packed(self, q, k, v, cu_seqlens):
        return self.attend(q, k, v, cu_seqlens=cu_seqlens)  # the op restarts at each boundary

    def new_decode_cache(self, q, k, v, max_length):
        return KVCache.like(k, v, max_length)

    def attend_cached(self, q, k, v, cache, start):
        """Each query reads its window and power offsets from the KV cache (``ppa_prefill``)."""
        k_all, v_all = cache.append(k, v, start)
        return ppa_prefill(q, k_all, v_all, self.config.ppa_power, self.config.ppa_window,
                           start=start, scale=self.softmax_scale)


def attention_spec(config, layer_number: int, provider):
    return self_attention_spec(PPACoreAttention, provider)


def check_knobs(config) -> None:
    """Ranges of ppa_power and ppa_window (whether or not a layer uses ppa)."""
    if not (isinstance(config.ppa_power, (int, float)) and 0.0 <= config.ppa_power <= 1.0):
        knob_error("ppa_power", config.ppa_power, "a number in [0, 1]")
    if not isinstance(config.ppa_window, int) or config.ppa_window < 0:
        knob_error("ppa_window", config.ppa_window, "an integer >= 0")


def validate(config) -> None:
    # check_knobs checks the range of ppa_power and ppa_window; offsets are exact only for a power
    # that is a rational with a small denominator, so refuse what would otherwise be rounded.
    ppa_power_fraction(config.ppa_power, what="ppa_power")


def ppa_pairs(L: int, power: float, window: int) -> int:
    """Pairs attended by PPA: the dense window (offsets 0..w) plus offsets j > w in S_p."""
    dense = int(np.minimum(np.arange(L), window).sum()) + L
    # queries i >= j see key i - j through offset j
    sparse = sum(L - j for j in ppa_offsets(power, L - 1) if j > window) if L > 1 else 0
    return dense + sparse


def core_flops(config, L: int) -> float:
    """QK^T and PV over the attended pairs, every head."""
    pairs = ppa_pairs(L, config.ppa_power, config.ppa_window)
    return 4.0 * pairs * config.num_attention_heads * config.kv_channels


VARIANT = Variant(
    name="ppa",
    summary="power-based partial attention: window band + offsets where floor(j^p) increments",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
    knobs=("ppa_",),
    check_knobs=check_knobs,
    core_flops=core_flops,
    context_parallel="all_to_all",
    decode_cache="kv",
)
