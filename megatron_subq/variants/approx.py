"""approx: deconstructing-attention's Taylor-form linear attention (Appendix I, Eq. 14-17).

Only the attention core changes: megatron's ``SelfAttention`` (fused QKV column-parallel
projection, RoPE, GQA, row-parallel output) with ``ApproxCoreAttention``, which calls
``ops.approx_attention`` on the raw projections (the op applies the d_h^{-1/4} pre-scaling).
RoPE is kept: the variant approximates ``softmax(QK^T/sqrt(d_h))`` of the standard layer, whose Q
and K are rotated; a per-position rotation of q and k leaves the linear-attention form intact.
No parameters of its own, no communication of its own: the recurrence runs along the sequence
inside one head, and TP shards heads. Under context parallelism it takes the all-to-all or state
passing (its sums are additive: ``chunk_state`` / ``attend_from_state``).
"""

from __future__ import annotations

import torch

from ..attention import SubqCoreAttention, copy_state_
from ..ops import approx_attention, approx_decode_step, approx_empty_state, approx_prefill
from ..ops.approx import ApproxState, _phi2, _prescale, accumulation_dtype
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

    def new_decode_cache(self, q, k, v, max_length):
        """The running sums (``ApproxState``) per key/value head: constant size."""
        return approx_empty_state(k.shape[0], k.shape[2], k.shape[3], device=k.device,
                                  dtype=accumulation_dtype(q.dtype))

    def attend_cached(self, q, k, v, cache, start):
        if q.shape[1] == 1:
            return approx_decode_step(q[:, 0], k[:, 0], v[:, 0], cache)[:, None]
        out, state = approx_prefill(q, k, v, state=cache, impl=self.config.subq_impl)
        copy_state_(cache, state)
        return out

    def chunk_state(self, q, k, v):
        """The running sums these tokens alone leave (``ApproxState``'s tensors, per key/value
        head, accumulation dtype): all additive over chunks. The token count, which the mean
        term needs, comes as ``attend_from_state``'s host int, not as a tensor to sync on."""
        ks = _prescale(k)
        vf = v.to(ks.dtype)
        k2 = _phi2(ks)
        return (vf.sum(1), ks.sum(1), k2.sum(1), torch.einsum("bthd,bthe->bhde", ks, vf),
                torch.einsum("bthd,bthe->bhde", k2, vf))

    def attend_from_state(self, q, k, v, state, tokens_before):
        """The chunk continuing from the earlier tokens' summed state: ``ops.approx_prefill``
        with ``subq_impl`` (the kernel where ``attend`` takes it — it returns the starting
        state's gradient — else the chunked PyTorch form), whose mean term counts from
        ``tokens_before``."""
        return approx_prefill(q, k, v, state=ApproxState(*state, length=tokens_before),
                              impl=self.config.subq_impl)[0]


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
    state_passing=True,
    decode_cache="state",
)
