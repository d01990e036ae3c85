"""standard: causal softmax attention, the Transformer++ baseline (RMSNorm, RoPE, SwiGLU, GQA).

The core is ``ops.standard_attention`` through torch SDPA (cuDNN / flash on GPUs, the math
backend on the CPU) — not megatron's local ``DotProductAttention``, which allocates on CUDA. With
Transformer Engine, TE's fused attention is used instead.
"""

from __future__ import annotations

from megatron.core.models.backends import BackendSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import deprecate_inference_params

from ..attention import KVCache, SubqCoreAttention
from ..ops import standard_attention
from ..ops.standard import standard_prefill
from .base import Variant, causal_pairs


class SDPACoreAttention(SubqCoreAttention):
    """Softmax attention through ``ops.standard_attention`` (scale 1/sqrt(d) unless configured).
    Packed sequences: one SDPA call per document (the default ``attend_packed``). Decoding: a
    KV cache (``ops.standard_prefill`` over it)."""

    def attend(self, q, k, v):
        return standard_attention(q, k, v, causal=True, scale=self.softmax_scale,
                                  impl=self.config.subq_impl)

    def new_decode_cache(self, q, k, v, max_length):
        return KVCache.like(k, v, max_length)

    def attend_cached(self, q, k, v, cache, start):
        k_all, v_all = cache.append(k, v, start)
        return standard_prefill(q, k_all, v_all, start=start, scale=self.softmax_scale,
                                impl=self.config.subq_impl)


class SubqSelfAttention(SelfAttention):
    """megatron's ``SelfAttention``, decoding through the variant's own cache.

    With megatron's static inference context, ``_adjust_key_value_for_inference`` (the hook
    megatron calls between the QKV projection and RoPE) does not fill megatron's KV cache: it
    slices the rotary embedding to the chunk's positions and hands the context to the core
    (``SubqCoreAttention.bind_decode``), whose ``attend_cached`` keeps its own cache (a KV
    cache or a recurrent state: ``Variant.decode_cache``). A core that is not ours (Transformer
    Engine's, for standard) keeps megatron's KV cache, a multi-token chunk after the first
    aligned bottom-right. Every variant's ``SelfAttention`` subclass derives from this one."""

    def _adjust_key_value_for_inference(self, inference_context, query, key, value,
                                        rotary_pos_emb, rotary_pos_cos=None, rotary_pos_sin=None,
                                        rotary_pos_cos_sin=None, sequence_len_offset=None, *,
                                        inference_params=None):
        context = deprecate_inference_params(inference_context, inference_params)
        if context is None or self.training:
            return super()._adjust_key_value_for_inference(
                context, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                rotary_pos_cos_sin, sequence_len_offset)
        if not context.is_static_batching() or self.config.flash_decode:
            raise ValueError(f"{type(self).__name__}: decoding needs megatron's static inference "
                             "context without flash_decode; allowed: StaticInferenceContext, "
                             "flash_decode=False")
        start = context.sequence_len_offset
        end = start + key.shape[0]
        if end > context.max_sequence_length:
            raise ValueError(f"{type(self).__name__}: positions up to {end} exceed the inference "
                             f"context's max_sequence_length={context.max_sequence_length}")
        if not isinstance(self.core_attention, SubqCoreAttention):
            out = list(super()._adjust_key_value_for_inference(
                context, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                rotary_pos_cos_sin, sequence_len_offset))
            if start > 0 and key.shape[0] > 1:  # a later prefill chunk: causal, bottom-right
                out[4] = AttnMaskType.causal_bottom_right
            return tuple(out)
        if rotary_pos_emb is not None:
            q_pos, k_pos = rotary_pos_emb
            rotary_pos_emb = (q_pos[start:end], k_pos[start:end])
        self.core_attention.bind_decode(context, start)
        return query, key, value, rotary_pos_emb, self.attn_mask_type, None

    def forward(self, *args, **kwargs):
        """megatron's; a decoding hand-off the core did not consume (an error in between) is
        dropped, so it cannot reach a later forward."""
        try:
            return super().forward(*args, **kwargs)
        finally:
            if isinstance(self.core_attention, SubqCoreAttention):
                self.core_attention._decode = None


def self_attention_spec(core_attention: type, provider: BackendSpecProvider,
                        module: type = SubqSelfAttention,
                        submodules: type = SelfAttentionSubmodules,
                        **extra) -> ModuleSpec:
    """``SubqSelfAttention`` (megatron's: fused QKV, RoPE, GQA, row-parallel output; decoding
    through the core's own cache) around a core, its linears from ``provider``.

    A variant with projections of its own passes its ``SelfAttention`` subclass, its submodules
    dataclass and the extra submodules (Superlinear: ``linear_qs``)."""
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=submodules(
            linear_qkv=provider.column_parallel_linear(),
            core_attention=core_attention,
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
            **extra,
        ),
    )


def attention_spec(config, layer_number: int, provider: BackendSpecProvider) -> ModuleSpec:
    """megatron's ``SelfAttention`` around the provider's softmax core (SDPA, or TE's)."""
    return self_attention_spec(provider.core_attention(), provider)


def standard_core_flops(config, L: int) -> float:
    """QK^T and PV over the causal pairs, every head (also the Q/K-source variants' count)."""
    return 4.0 * causal_pairs(L) * config.num_attention_heads * config.kv_channels


VARIANT = Variant(
    name="standard",
    summary="causal softmax attention (Transformer++ baseline)",
    attention_spec=attention_spec,
    packed_sequences=True,
    core_flops=standard_core_flops,
    context_parallel="all_to_all",
    decode_cache="kv",
)
