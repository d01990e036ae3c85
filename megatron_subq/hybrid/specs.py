"""Layer specs of the hybrid host: one spec per symbol of ``hybrid_override_pattern``.

=====  ==============================================================================
``M``  megatron's ``MambaLayer``: input norm, Mamba-2 mixer (``mamba_mixer_class``), residual
``*``  megatron's ``TransformerLayer`` with only an input norm and the attention slot of that
       layer (``slots.attention_slot_spec``: any variant whose ``hosts`` include ``hybrid``)
``-``  megatron's ``MLPLayer``: pre-MLP norm, dense MLP (``config.activation_func``)
``E``  megatron's ``MoETransformerLayer``: pre-MLP norm, ``MoELayer`` (router, token
       dispatcher, routed experts, shared expert) from megatron's own MoE spec builder
=====  ==============================================================================

Norms are always separate modules (``provider.layer_norm()``: ``LocalNorm``, or TE's norm), never
fused into the following linear as megatron's TE Mamba spec does, so the state-dict keys
(``layers.N.norm.weight``, ``input_layernorm``, ``pre_mlp_layernorm``) are the same with or
without Transformer Engine and conversion has one layout.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from ..compat import install_te_absent_fallbacks
from ..config import SubqTransformerConfig
from ..slots import attention_slot_spec, get_spec_provider


def _norm(config, provider: BackendSpecProvider) -> type:
    return provider.layer_norm(rms_norm=config.normalization == "RMSNorm")


def mamba_layer_spec(config: SubqTransformerConfig, provider: BackendSpecProvider) -> ModuleSpec:
    """``M``: norm → Mamba-2 mixer (column-parallel ``in_proj``, row-parallel ``out_proj``)."""
    from ..ssm import mamba_mixer_class  # noqa: PLC0415 (mamba_ssm probing only when needed)

    mixer = ModuleSpec(module=mamba_mixer_class(config, config.mamba_impl), submodules=MambaMixerSubmodules(
        in_proj=provider.column_parallel_linear(), out_proj=provider.row_parallel_linear()))
    return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=_norm(config, provider), mixer=mixer, mamba_bda=get_bias_dropout_add))


def attention_layer_spec(config: SubqTransformerConfig, layer_number: int,
                         provider: BackendSpecProvider) -> ModuleSpec:
    """``*`` at global layer ``layer_number``: norm → that layer's attention slot; no MLP."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=_norm(config, provider),
        self_attention=attention_slot_spec(config, layer_number, provider),
        self_attn_bda=get_bias_dropout_add))


def mlp_layer_spec(config: SubqTransformerConfig, provider: BackendSpecProvider) -> ModuleSpec:
    """``-``: norm → dense MLP (gated or not per ``config.gated_linear_unit``)."""
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear()))
    return ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_norm(config, provider), mlp=mlp, mlp_bda=get_bias_dropout_add))


def moe_layer_spec(config: SubqTransformerConfig, provider: BackendSpecProvider) -> ModuleSpec:
    """``E``: norm → megatron's ``MoELayer`` (``SequentialMLP`` experts, or grouped GEMM when
    ``config.moe_grouped_gemm``; a shared expert when ``moe_shared_expert_intermediate_size``)."""
    install_te_absent_fallbacks()
    moe = get_moe_module_spec_for_backend(
        backend=provider, num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        moe_use_legacy_grouped_gemm=config.moe_use_legacy_grouped_gemm)
    return ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_norm(config, provider), mlp=moe, mlp_bda=get_bias_dropout_add))


def hybrid_layer_spec(config: SubqTransformerConfig, layer_number: int,
                      provider: Optional[BackendSpecProvider] = None) -> ModuleSpec:
    """The spec of global layer ``layer_number`` (1-based) per its pattern symbol."""
    if provider is None:
        provider = get_spec_provider(config=config)
    symbol = config.hybrid_override_pattern[layer_number - 1]
    if symbol == "M":
        return mamba_layer_spec(config, provider)
    if symbol == "*":
        return attention_layer_spec(config, layer_number, provider)
    if symbol == "-":
        return mlp_layer_spec(config, provider)
    return moe_layer_spec(config, provider)
