"""What a variant is: a name, a spec builder for the layer's attention slot, and a validator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron.core.transformer.spec_utils import ModuleSpec


def _no_checks(config) -> None:
    return None


@dataclass(frozen=True)
class Variant:
    """One attention variant.

    ``attention_spec(config, layer_number, provider)`` returns the ``ModuleSpec`` that fills the
    transformer layer's ``self_attention`` slot, from the module classes of ``provider`` (a
    megatron-core ``BackendSpecProvider``: ``column_parallel_linear()``, ``row_parallel_linear()``,
    ``core_attention()``, ``layer_norm()``): usually megatron's ``SelfAttention`` with the
    variant's ``core_attention``, or a module of the variant's own where it needs its own
    projections. Its modules take their process groups from the ``pg_collection`` megatron hands
    them and do not depend on ``GPTModel``, so the spec fits any host's attention slot
    (``slots.attention_slot_spec``); the Q/K-source variants also need the GPT host's stream
    layers (``model.StreamTransformerLayer``).
    ``validate(config)`` runs in ``SubqTransformerConfig.__post_init__`` for the variants in use
    and raises ``ValueError`` naming the field. ``packed_sequences``: its attention takes
    megatron's packed (THD) sequences and keeps the documents apart (``--reset-attention-mask``).
    """

    name: str
    summary: str
    attention_spec: Callable[..., ModuleSpec]
    validate: Callable[..., None] = _no_checks
    packed_sequences: bool = False
