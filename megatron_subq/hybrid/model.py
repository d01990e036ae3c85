"""``build_hybrid_model``: megatron-core's ``MambaModel`` over a ``HybridStack``.

The layers follow ``config.hybrid_override_pattern`` (``hybrid/specs.py``); the attention slots
take ``config.layer_variants``. Defaults are Nemotron-H's: no position embedding (NoPE), untied
embeddings; RoPE stays available (``position_embedding_type="rope"``).
"""

from __future__ import annotations

from typing import Optional

from megatron.core import parallel_state
from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import SubqTransformerConfig
from ..slots import check_config, check_model_sizes, get_spec_provider
from .specs import hybrid_layer_spec
from .stack import HybridStack, HybridStackSubmodules


def get_hybrid_stack_spec(config: SubqTransformerConfig,
                          use_te: Optional[bool] = None) -> ModuleSpec:
    """The ``HybridStack`` spec of the whole pattern (every layer; the stack builds its stage's)."""
    check_config(config)
    if not config.is_hybrid:
        raise ValueError("hybrid_override_pattern is None: allowed a pattern of M, *, -, E "
                         "(one per layer) for the hybrid host; use build_gpt_model for a GPT")
    provider = get_spec_provider(use_te, config)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        layer_specs=[hybrid_layer_spec(config, n, provider)
                     for n in range(1, config.num_layers + 1)],
        final_norm=provider.layer_norm(rms_norm=config.normalization == "RMSNorm")))


def build_hybrid_model(config: SubqTransformerConfig, vocab_size: int, max_sequence_length: int,
                       use_te: Optional[bool] = None, **mamba_kwargs) -> MambaModel:
    """A megatron-core ``MambaModel`` of ``config.hybrid_override_pattern`` for this pipeline
    stage. Any ``MambaModel`` argument can be passed through ``mamba_kwargs``."""
    check_config(config)
    check_model_sizes(vocab_size, max_sequence_length)
    if "hybrid_override_pattern" in mamba_kwargs:
        raise ValueError("hybrid_override_pattern is a config field: set "
                         "SubqTransformerConfig.hybrid_override_pattern, not a model argument")
    stack = get_hybrid_stack_spec(config, use_te)  # checks the pattern first
    if parallel_state.model_parallel_is_initialized():
        mamba_kwargs.setdefault("pre_process", parallel_state.is_pipeline_first_stage())
        mamba_kwargs.setdefault("post_process", parallel_state.is_pipeline_last_stage())
    mamba_kwargs.setdefault("position_embedding_type", "none")
    mamba_kwargs.setdefault("share_embeddings_and_output_weights", False)
    return MambaModel(config=config, mamba_stack_spec=stack, vocab_size=vocab_size,
                      max_sequence_length=max_sequence_length,
                      hybrid_override_pattern=config.hybrid_override_pattern, **mamba_kwargs)
