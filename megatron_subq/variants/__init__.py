"""The variant registry: name -> ``Variant``.

Adding a variant = one module in this folder that defines ``VARIANT`` + one line below.
"""

from __future__ import annotations

from typing import Dict

from . import (approx, asa, fixed_seq_qk, mlp, nonapprox, ppa, rnd_emb_qk, sas, standard,
               static_emb_qk, superlinear)
from .base import SpecBackend, Variant

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

__all__ = ["VARIANTS", "Variant", "SpecBackend"]
