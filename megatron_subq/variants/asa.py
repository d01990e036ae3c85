"""asa: Adaptive Subquadratic Attention — megatron's ``SelfAttention`` with an ASA core.

Only the attention core changes: Q, K, V come from megatron's fused QKV projection (with RoPE and
GQA), and ``ASACoreAttention`` holds the per-head projections ``P_Q, P_K`` (``[H, D, m]``, m =
``asa_rank``) and calls ``ops.asa_attention``. With TP=N each rank owns the P_Q/P_K of its H/N
query heads (head-sharded, initialised as the full master tensor so TP=N starts from TP=1's
weights), and ASA needs no communication of its own: the causal recurrence runs along the
sequence *inside* one head, and megatron's column/row-parallel projections around the core already
gather the sequence under SP.

Init: ``P_Q, P_K ~ N(0, 1/D)`` (fan-in). Then ``q P_Q`` has about the per-coordinate scale of
``q``, so the feature softmaxes start input-dependent but far from one-hot: neither uniform
(which would make every query attend like a running mean and stall learning of selectivity), nor
saturated (vanishing softmax gradients). megatron's ``init_method`` (std 0.02) is meant for
d_model-sized fan-ins and would start the features almost uniform at D = 64…128.
"""

from __future__ import annotations

import math

import torch

from ..attention import SubqCoreAttention, copy_state_
from ..ops import ASAState, asa_attention, asa_decode_step, asa_empty_state, asa_prefill
from ..ops.asa import ASA_NORMALIZE_MODES, accumulation_dtype, asa_chunk_state
from ..parallel import head_sharded_parameter
from .base import Variant, knob_error
from .standard import self_attention_spec


class ASACoreAttention(SubqCoreAttention):
    """Causal ASA on this rank's heads. Parameters: ``p_q``, ``p_k`` ``[H_local, D, m]``."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        if self.softmax_scale is not None:
            raise ValueError(f"softmax_scale={self.softmax_scale!r} is invalid for asa: allowed "
                             "None (ASA's feature softmaxes are unscaled; P_Q sets the "
                             "temperature)")
        full_shape = (config.num_attention_heads, config.kv_channels, config.asa_rank)
        std = 1.0 / math.sqrt(config.kv_channels)
        device = None
        if torch.cuda.is_available() and not config.use_cpu_initialization:
            device = torch.cuda.current_device()

        def init(master: torch.Tensor) -> None:
            torch.nn.init.normal_(master, mean=0.0, std=std)

        self.p_q = head_sharded_parameter(full_shape, init, config.params_dtype, device,
                                          tp_group=self.tp_group)
        self.p_k = head_sharded_parameter(full_shape, init, config.params_dtype, device,
                                          tp_group=self.tp_group)

    def attend(self, q, k, v, cu_seqlens=None):
        return asa_attention(q, k, v, self.cp_heads(self.p_q), self.cp_heads(self.p_k),
                             normalize=self.config.asa_normalize,
                             impl=self.config.subq_impl, cu_seqlens=cu_seqlens)

    def attend_packed(self, q, k, v, cu_seqlens):
        return self.attend(q, k, v, cu_seqlens=cu_seqlens)  # the state restarts per document

    def new_decode_cache(self, q, k, v, max_length):
        """(S, z) per query head (``ASAState``): constant size."""
        return asa_empty_state(q.shape[0], q.shape[2], self.p_q.shape[2], v.shape[3],
                               device=q.device, dtype=accumulation_dtype(q.dtype))

    def attend_cached(self, q, k, v, cache, start):
        normalize = self.config.asa_normalize
        if q.shape[1] == 1:
            return asa_decode_step(q[:, 0], k[:, 0], v[:, 0], self.p_q, self.p_k, cache,
                                   normalize=normalize)[:, None]
        out, state = asa_prefill(q, k, v, self.p_q, self.p_k, normalize=normalize, state=cache,
                                 impl=self.config.subq_impl)
        copy_state_(cache, state)
        return out

    def chunk_state(self, q, k, v):
        """(S, z) = (Σ k'ᵀ v, Σ k') of this chunk alone, fp32: additive over chunks
        (``ops.asa_chunk_state``: the kernel's state scan where ``attend`` takes the kernel)."""
        return tuple(asa_chunk_state(q, k, v, self.cp_heads(self.p_q), self.cp_heads(self.p_k),
                                     impl=self.config.subq_impl))

    def attend_from_state(self, q, k, v, state, tokens_before):
        """The chunk continuing from the earlier tokens' summed state (S0, z0):
        ``ops.asa_prefill`` with ``subq_impl`` (the kernel where ``attend`` takes it — it
        returns the starting state's gradient — else the chunked PyTorch form); "mean" counts
        the ``tokens_before`` earlier tokens exactly (a host int)."""
        return asa_prefill(q, k, v, self.cp_heads(self.p_q), self.cp_heads(self.p_k),
                           normalize=self.config.asa_normalize, state=ASAState(*state),
                           impl=self.config.subq_impl, tokens_before=tokens_before)[0]


def attention_spec(config, layer_number: int, provider):
    return self_attention_spec(ASACoreAttention, provider)


def check_knobs(config) -> None:
    """Ranges of asa_rank and asa_normalize (whether or not a layer uses asa)."""
    m = config.asa_rank
    if m is not None and (not isinstance(m, int) or m < 1):
        knob_error("asa_rank", m, "a positive integer m < kv_channels")
    if config.asa_normalize not in ASA_NORMALIZE_MODES:
        knob_error("asa_normalize", config.asa_normalize, f"one of {ASA_NORMALIZE_MODES}")


def resolve(config) -> None:
    """asa_rank defaults to min(64, kv_channels // 2) (at least 1), and must be < kv_channels."""
    D = config.kv_channels
    if config.asa_rank is None:
        config.asa_rank = max(1, min(64, D // 2))
    if not config.asa_rank < D:
        knob_error("asa_rank", config.asa_rank, f"an integer in [1, kv_channels={D})")


def validate(config) -> None:
    # asa_rank and asa_normalize: check_knobs and resolve above.
    if config.softmax_scale is not None:
        raise ValueError(f"softmax_scale={config.softmax_scale!r} is invalid with asa layers: "
                         "allowed None (ASA's feature softmaxes are unscaled)")


def core_flops(config, L: int) -> float:
    """Feature maps q P_Q, k P_K (D -> m), state k'^T v accumulation and readout q' S (m x D),
    plus the normaliser q' . sum k' (m)."""
    H, D, m = config.num_attention_heads, config.kv_channels, config.asa_rank
    return L * H * (2 * 2 * D * m + 2 * 2 * m * D + 2 * 2 * m)


VARIANT = Variant(
    name="asa",
    summary="causal linear attention with learned per-head softmax feature maps (P_Q, P_K)",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
    knobs=("asa_",),
    check_knobs=check_knobs,
    resolve=resolve,
    core_flops=core_flops,
    context_parallel="all_to_all",
    state_passing=True,
    decode_cache="state",
)
