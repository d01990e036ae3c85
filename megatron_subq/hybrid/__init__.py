"""The hybrid host: Mamba-2, attention, MLP and MoE layers (Nemotron-H layout) on megatron-core's
``MambaModel``; every ``*`` slot is built by the slot builder (``slots.attention_slot_spec``).

    build_hybrid_model(config, vocab_size, max_sequence_length, ...)   megatron's MambaModel
    get_hybrid_stack_spec(config)                                      its HybridStack spec
    hybrid_preset(name, **overrides) -> (config, kwargs)               named shapes
"""

from .model import build_hybrid_model, get_hybrid_stack_spec
from .presets import HYBRID_PRESETS, hybrid_preset
from .stack import HybridStack, HybridStackSubmodules

__all__ = ["HYBRID_PRESETS", "HybridStack", "HybridStackSubmodules", "build_hybrid_model",
           "get_hybrid_stack_spec", "hybrid_preset"]
