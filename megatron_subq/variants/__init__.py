"""The variant registry: name -> ``Variant``.

Adding a variant = one module in this folder that defines ``VARIANT`` + one line below.
"""

from __future__ import annotations

from typing import Dict

from . import standard
from .base import SpecBackend, Variant

VARIANTS: Dict[str, Variant] = {
    v.name: v
    for v in (
        standard.VARIANT,
    )
}

__all__ = ["VARIANTS", "Variant", "SpecBackend"]
