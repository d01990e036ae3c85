"""What a variant is: a name, a spec builder for the layer's attention slot, and a validator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron.core.transformer.spec_utils import ModuleSpec


@dataclass(frozen=True)
class SpecBackend:
    """The module classes a spec is assembled from: megatron-core's local modules, or TE's."""

    use_te: bool
    column_parallel_linear: type
    row_parallel_linear: type
    norm: type
    core_attention: type  # softmax attention of the standard variant


def _no_checks(config) -> None:
    return None


@dataclass(frozen=True)
class Variant:
    """One attention variant.

    ``attention_spec(config, layer_number, backend)`` returns the ``ModuleSpec`` that fills the
    transformer layer's ``self_attention`` slot: usually megatron's ``SelfAttention`` with the
    variant's ``core_attention``, or a module of the variant's own where it needs its own
    projections. It must not depend on ``GPTModel`` so it fits ``MambaStack``'s attention slot.
    ``validate(config)`` runs in ``SubqTransformerConfig.__post_init__`` for the variants in use
    and raises ``ValueError`` naming the field. ``packed_sequences``: its attention takes
    megatron's packed (THD) sequences and keeps the documents apart (``--reset-attention-mask``).
    """

    name: str
    summary: str
    attention_spec: Callable[..., ModuleSpec]
    validate: Callable[..., None] = _no_checks
    packed_sequences: bool = False
