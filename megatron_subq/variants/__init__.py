"""The variant registry: name -> ``Variant``.

Adding a variant = one module in this folder that defines ``VARIANT`` + one line below.
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


def packed_sequence_variants() -> list:
    """Names of the registered variants whose attention takes packed sequences (``cu_seqlens``
    through ``attend_packed``), sorted: a query on the registry, for the trainer's checks."""
    return sorted(name for name, variant in VARIANTS.items() if variant.packed_sequences)


__all__ = ["VARIANTS", "Variant", "packed_sequence_variants"]
