"""The variant registry: name -> ``Variant``.

Adding a variant = one module in this folder that defines ``VARIANT`` + one line below
(docs/architecture.md has the whole recipe). ``register_variant`` adds one at run time (a
plugin outside this package, or a test).
"""

from __future__ import annotations

from typing import Dict

from . import (approx, asa, fixed_seq_qk, mlp, nonapprox, ppa, rnd_emb_qk, sas, standard,
               static_emb_qk, superlinear)
from .base import Variant

VARIANTS: Dict[str, Variant] = {
    v.name: v
    for v in (
        standard.VARIANT,
        asa.VARIANT,
        ppa.VARIANT,
        sas.VARIANT,
        mlp.VARIANT,
        approx.VARIANT,
        nonapprox.VARIANT,
        rnd_emb_qk.VARIANT,
        fixed_seq_qk.VARIANT,
        static_emb_qk.VARIANT,
        superlinear.VARIANT,
    )
}


def register_variant(variant: Variant) -> Variant:
    """Add ``variant`` to the registry (configs, the trainer's ``--attention-variant`` choices
    made after this call, FLOPs and the queries below all see it). Refuses a name already
    registered: ValueError. Returns the variant."""
    if not isinstance(variant, Variant):
        raise TypeError(f"variant={variant!r} is invalid: allowed a megatron_subq Variant")
    if variant.name in VARIANTS:
        raise ValueError(f"variant name {variant.name!r} is invalid: already registered; allowed "
                         f"a name not in {sorted(VARIANTS)}")
    VARIANTS[variant.name] = variant
    return variant


def unregister_variant(name: str) -> None:
    """Remove a variant added by ``register_variant`` (KeyError if ``name`` is not registered)."""
    del VARIANTS[name]


def fixed_input_variants() -> list:
    """Names of the variants whose Q/K come from a fixed input row, in registry order (the
    order of their rows in model.py's streams)."""
    return [name for name, variant in VARIANTS.items() if variant.fixed_input]


def embedding_qk_variants() -> list:
    """Names of the variants whose Q/K come from the batch's token embeddings."""
    return [name for name, variant in VARIANTS.items() if variant.qk_from_embeddings]


def packed_sequence_variants() -> list:
    """Names of the registered variants whose attention takes packed sequences (``cu_seqlens``
    through ``attend_packed``), sorted: a query on the registry, for the trainer's checks."""
    return sorted(name for name, variant in VARIANTS.items() if variant.packed_sequences)


__all__ = ["VARIANTS", "Variant", "embedding_qk_variants", "fixed_input_variants",
           "packed_sequence_variants", "register_variant", "unregister_variant"]
