"""The GPT host: a Transformer++ layer around each layer's attention slot, the block, the model.

``get_gpt_layer_spec(config, n)`` is a pre-norm layer (norms, SwiGLU MLP, bias-dropout-adds)
whose ``self_attention`` slot is ``slots.attention_slot_spec(config, n, provider)``: the variant
of layer n. ``get_gpt_block_spec`` returns one such spec per layer of this pipeline stage, so
hybrids mix variants layer by layer. ``build_gpt_model`` wraps it in megatron-core's
``GPTModel``. ``use_te`` picks the spec provider (``slots.get_spec_provider``).
"""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from .config import SubqTransformerConfig
from .model import model_class
from .slots import (
    HAVE_TE,
    attention_slot_spec,
    check_config,
    check_model_sizes,
    get_spec_provider,
)


def _norm(config, provider) -> type:
    """The provider's norm for ``config.normalization`` (TE's and ours read it themselves too)."""
    return provider.layer_norm(rms_norm=config.normalization == "RMSNorm")


class SkippedTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` that passes its input through unchanged: the paper's *skip* ablation
    (``config.skip_variant_layers``). It builds and keeps all its parameters, so a trained
    checkpoint loads unchanged (same state-dict keys); its attention *and* its MLP are skipped —
    the whole layer is removed, as the paper removes the odd layers of a trained hybrid."""

    def forward(self, hidden_states, *args, context=None, **kwargs):
        return hidden_states, context


def get_gpt_layer_spec(config: SubqTransformerConfig, layer_number: int,
                       use_te: Optional[bool] = None) -> ModuleSpec:
    """The spec of layer ``layer_number`` (1-based, global over pipeline stages)."""
    provider = get_spec_provider(use_te, config)
    self_attention = attention_slot_spec(config, layer_number, provider)  # checks the arguments
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
        linear_fc1=provider.column_parallel_linear(),
        linear_fc2=provider.row_parallel_linear()))
    skipped = (config.skip_variant_layers
               and config.layer_variants[layer_number - 1] != "standard")
    return ModuleSpec(
        module=SkippedTransformerLayer if skipped else TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_norm(config, provider),
            self_attention=self_attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=_norm(config, provider),
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def get_gpt_block_spec(config: SubqTransformerConfig, use_te: Optional[bool] = None,
                       vp_stage: Optional[int] = None,
                       pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """One layer spec per layer built on this pipeline stage (all layers without PP)."""
    check_config(config)
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError("pipeline_model_parallel_layout is not supported by megatron_subq's "
                         "block spec; allowed: None (even split, or first/last-stage layer counts)")
    if parallel_state.model_parallel_is_initialized() or pp_rank is not None:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset, count = 0, config.num_layers
    layer_specs = [get_gpt_layer_spec(config, n, use_te)
                   for n in range(offset + 1, offset + count + 1)]
    return TransformerBlockSubmodules(layer_specs=layer_specs,
                                      layer_norm=_norm(config, get_spec_provider(use_te, config)))


def build_gpt_model(config: SubqTransformerConfig, vocab_size: int, max_sequence_length: int,
                    use_te: Optional[bool] = None, vp_stage: Optional[int] = None,
                    **gpt_kwargs) -> GPTModel:
    """A megatron-core ``GPTModel`` whose layers follow ``config.layer_variants``.

    Defaults are Transformer++'s: RoPE, untied embeddings; this pipeline stage's pre/post
    processing. Any ``GPTModel`` argument can be passed through ``gpt_kwargs``.
    """
    check_config(config)
    check_model_sizes(vocab_size, max_sequence_length)
    if parallel_state.model_parallel_is_initialized():
        gpt_kwargs.setdefault("pre_process",
                              parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                     vp_stage=vp_stage))
        gpt_kwargs.setdefault("post_process",
                              parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                                    vp_stage=vp_stage))
    gpt_kwargs.setdefault("position_embedding_type", "rope")
    gpt_kwargs.setdefault("share_embeddings_and_output_weights", False)
    # StreamGPTModel (a GPTModel subclass) only when a layer takes Q/K from a carried stream
    return model_class(config)(
        config=config,
        transformer_layer_spec=get_gpt_block_spec(config, use_te, vp_stage=vp_stage),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        vp_stage=vp_stage,
        **gpt_kwargs,
    )


__all__ = ["HAVE_TE", "SkippedTransformerLayer", "build_gpt_model", "get_gpt_block_spec",
           "get_gpt_layer_spec"]
