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

from ..attention import SubqCoreAttention
from ..ops import standard_attention
from .base import Variant, causal_pairs


class SDPACoreAttention(SubqCoreAttention):
    """Softmax attention through ``ops.standard_attention`` (scale 1/sqrt(d) unless configured).
    Packed sequences: one SDPA call per document (the default ``attend_packed``)."""

    def attend(self, q, k, v):
        return standard_attention(q, k, v, causal=True, scale=self.softmax_scale,
                                  impl=self.config.subq_impl)


def self_attention_spec(core_attention: type, provider: BackendSpecProvider,
                        module: type = SelfAttention, submodules: type = SelfAttentionSubmodules,
                        **extra) -> ModuleSpec:
    """megatron's ``SelfAttention`` (fused QKV, RoPE, GQA, row-parallel output) around a core,
    its linears from ``provider``.

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
)
