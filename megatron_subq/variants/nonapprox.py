"""nonapprox: softmax over time of one self-gated scalar per token (Eq. 7-8 of the paper).

``s_j = sum(SiLU(q_j) * k_j) / sqrt(d_h)``, ``o_i = sum_{j<=i} exp(s_j) v_j / sum_{j<=i} exp(s_j)``.
megatron's ``SelfAttention`` (fused QKV projection, GQA, row-parallel output) around
``NonapproxCoreAttention``, which calls ``ops.nonapprox_attention`` on the raw projections (the op
applies SiLU to q).

No RoPE: there is no pairwise q_i.k_j for a relative position to enter, and q_j, k_j come from the
same token — rotating both by the same angle would cancel in a plain dot product and, through the
SiLU, only inject an absolute-position perturbation the paper does not have (its Eq. 8 is
``Q = SiLU(H W^Q)``, ``K, V = H W^{K,V}``). ``NoRopeSelfAttention`` drops the rotary embedding that
the layer passes. No parameters or communication of its own (TP shards heads). Under context
parallelism: the all-to-all, or state passing (its running softmax merges across chunks:
``states_before``).
"""

from __future__ import annotations

import dataclasses

import torch
from ..attention import SubqCoreAttention, copy_state_
from ..ops import (nonapprox_attention, nonapprox_decode_step, nonapprox_empty_state,
                   nonapprox_prefill)
from ..ops.dispatch import repeat_kv
from ..ops.nonapprox import NonapproxState, accumulation_dtype, token_scores
from .base import Variant
from .standard import SubqSelfAttention, self_attention_spec


class NonapproxCoreAttention(SubqCoreAttention):
    """Causal softmax over time of s_j = SiLU(q_j).k_j / sqrt(d_h), applied to v."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        if self.softmax_scale is not None:
            raise ValueError(f"softmax_scale={self.softmax_scale!r} is invalid for nonapprox: "
                             "allowed None (the score is scaled by 1/sqrt(kv_channels))")

    def attend(self, q, k, v):
        return nonapprox_attention(q, k, v, impl=self.config.subq_impl)

    def new_decode_cache(self, q, k, v, max_length):
        """The running softmax (``NonapproxState``) per query head: constant size."""
        return nonapprox_empty_state(q.shape[0], q.shape[2], v.shape[3], device=q.device,
                                     dtype=accumulation_dtype(q.dtype))

    def attend_cached(self, q, k, v, cache, start):
        if q.shape[1] == 1:
            return nonapprox_decode_step(q[:, 0], k[:, 0], v[:, 0], cache)[:, None]
        out, state = nonapprox_prefill(q, k, v, state=cache, impl=self.config.subq_impl)
        copy_state_(cache, state)
        return out

    def chunk_state(self, q, k, v):
        """These tokens' running softmax alone, per query head: (num, den) relative to their
        own maximum score, and that maximum (``NonapproxState``'s tensors)."""
        s = token_scores(q, k)  # [B, T, H], accumulation dtype
        top = s.max(dim=1).values  # [B, H]
        w = torch.exp(s - top.unsqueeze(1))
        vals = repeat_kv(v, q.shape[2]).to(s.dtype)
        return torch.einsum("bth,bthd->bhd", w, vals), w.sum(dim=1), top

    def states_before(self, chunks):
        """The online-softmax merge instead of a sum: running (num, den, max) through the
        chunks in order, each sum rescaled to the larger maximum (the first chunk starts from
        the empty state, max -inf)."""
        nums, dens, tops = chunks
        num, den = torch.zeros_like(nums[0]), torch.zeros_like(dens[0])
        top = torch.full_like(tops[0], float("-inf"))
        before = ([], [], [])
        for i in range(nums.shape[0]):
            for acc, value in zip(before, (num, den, top)):
                acc.append(value)
            new_top = torch.maximum(top, tops[i])
            old, own = torch.exp(top - new_top), torch.exp(tops[i] - new_top)
            num = num * old.unsqueeze(-1) + nums[i] * own.unsqueeze(-1)
            den, top = den * old + dens[i] * own, new_top
        return tuple(torch.stack(acc) for acc in before)

    def attend_from_state(self, q, k, v, state, tokens_before):
        """The chunk continuing the earlier tokens' running softmax: ``ops.nonapprox_prefill``
        with ``subq_impl`` (the kernel where ``attend`` takes it — it returns the starting
        state's gradient — else the chunked PyTorch form). ``tokens_before`` is not needed:
        the running softmax carries its own normaliser."""
        return nonapprox_prefill(q, k, v, state=NonapproxState(*state),
                                 impl=self.config.subq_impl)[0]


class NoRopeSelfAttention(SubqSelfAttention):
    """``SubqSelfAttention`` (megatron's) that ignores the rotary embedding it is given."""

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, **kwargs):
        return super().forward(hidden_states, attention_mask, key_value_states=key_value_states,
                               inference_context=inference_context, **kwargs)


def attention_spec(config, layer_number: int, provider):
    return dataclasses.replace(self_attention_spec(NonapproxCoreAttention, provider),
                               module=NoRopeSelfAttention)


def validate(config) -> None:
    if config.softmax_scale is not None:
        raise ValueError(f"softmax_scale={config.softmax_scale!r} is invalid with nonapprox "
                         "layers: allowed None (the score is scaled by 1/sqrt(kv_channels))")


def core_flops(config, L: int) -> float:
    """One score per token and head (SiLU(q) . k), then a running weighted sum of v."""
    H, D = config.num_attention_heads, config.kv_channels
    return L * H * (2 * D + 2 * D)


VARIANT = Variant(
    name="nonapprox",
    summary="softmax over time of one SiLU(q)-gated scalar per token (no pairwise q.k)",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
    core_flops=core_flops,
    context_parallel="all_to_all",
    state_passing=True,
    decode_cache="state",
)
