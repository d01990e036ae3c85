"""Named hybrid shapes: ``hybrid_preset(name, **overrides) -> (config, kwargs)``.

``config`` is a ``SubqTransformerConfig`` (any field overridable: parallel sizes,
``attention_variant``, ``perform_initialization``, ...); ``kwargs`` completes
``build_hybrid_model(config, **kwargs)`` (``vocab_size``, ``max_sequence_length``, MambaModel
arguments; overridable the same way).

* ``nemotron-3-nano-30b-a3b``: NVIDIA Nemotron-3-Nano-30B-A3B exactly (52 layers ``MEMEM*E…``,
  hidden 2688, 32 query / 2 KV heads of 128, NoPE, Mamba-2 64 heads × 64 with state 128 in 8
  groups, 128 squared-ReLU experts of 1856 top-6 with a shared expert of 3712, sigmoid router with
  expert bias, top-k scaling 2.5, vocabulary 131072, context 262144): 31,577,937,344
  parameters. The token dispatcher is ``allgather`` (runs everywhere); on GPUs with EP pass
  ``moe_token_dispatcher_type="alltoall"``.
* ``tiny-hybrid``: a few layers of every symbol at small widths, for tests and the quickstart.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

import torch
from megatron.core.activations import squared_relu

from ..config import SubqTransformerConfig

NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

_NEMOTRON_H_MOE = dict(  # what Nemotron-H's MoE and MLP layers share
    normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False,
    gated_linear_unit=False, activation_func=squared_relu,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_dtype="fp32", moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
)


def _nano() -> Tuple[dict, dict]:
    config = dict(
        _NEMOTRON_H_MOE, num_layers=len(NANO_PATTERN), hybrid_override_pattern=NANO_PATTERN,
        hidden_size=2688, num_attention_heads=32, num_query_groups=2, kv_channels=128,
        ffn_hidden_size=1856, mamba_num_heads=64, mamba_head_dim=64, mamba_state_dim=128,
        mamba_num_groups=8, num_moe_experts=128, moe_ffn_hidden_size=1856, moe_router_topk=6,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=3712,
        init_method_std=0.0173, params_dtype=torch.bfloat16, bf16=True,
        pipeline_dtype=torch.bfloat16)
    kwargs = dict(vocab_size=131072, max_sequence_length=262144, position_embedding_type="none",
                  share_embeddings_and_output_weights=False)
    return config, kwargs


def _tiny() -> Tuple[dict, dict]:
    config = dict(
        _NEMOTRON_H_MOE, num_layers=8, hybrid_override_pattern="M*EM-EM*",
        hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=128, mamba_num_heads=8, mamba_head_dim=16, mamba_state_dim=16,
        mamba_num_groups=2, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
        moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=64,
        moe_aux_loss_coeff=1e-2, init_method_std=0.02, params_dtype=torch.float32)
    kwargs = dict(vocab_size=256, max_sequence_length=256, position_embedding_type="none",
                  share_embeddings_and_output_weights=False)
    return config, kwargs


HYBRID_PRESETS: Dict[str, Callable[[], Tuple[dict, dict]]] = {
    "nemotron-3-nano-30b-a3b": _nano,
    "tiny-hybrid": _tiny,
}
"""name -> () -> (config fields, build_hybrid_model kwargs)."""


def hybrid_preset(name: str, **overrides) -> Tuple[SubqTransformerConfig, dict]:
    """(config, kwargs) of preset ``name``; an override goes to the config when it is a
    ``SubqTransformerConfig`` field, else to ``kwargs`` (``build_hybrid_model``'s arguments)."""
    if name not in HYBRID_PRESETS:
        raise ValueError(f"hybrid preset {name!r} is unknown: allowed {sorted(HYBRID_PRESETS)}")
    config, kwargs = HYBRID_PRESETS[name]()
    fields = {f.name for f in dataclasses.fields(SubqTransformerConfig) if f.init}
    kwarg_names = {"vocab_size", "max_sequence_length", "use_te", "pre_process", "post_process",
                   "position_embedding_type", "share_embeddings_and_output_weights",
                   "rotary_base", "rotary_percent", "fp16_lm_cross_entropy", "parallel_output",
                   "seq_len_interpolation_factor", "scatter_embedding_sequence_parallel",
                   "pg_collection"}
    for key, value in overrides.items():
        if key in fields:
            config[key] = value
        elif key in kwarg_names:
            kwargs[key] = value
        else:
            raise ValueError(f"hybrid_preset override {key}= is unknown: allowed "
                             "SubqTransformerConfig fields or build_hybrid_model arguments "
                             f"{sorted(kwarg_names)}")
    return SubqTransformerConfig(**config), kwargs
