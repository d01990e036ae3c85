"""The variant knobs as trainer flags: which config fields are knobs, and each one's flag name.

Below ``arguments`` (which builds the parser from them) and ``checkpointing`` (which compares a
checkpoint's stored knobs with a run's), so neither imports the other for them.
"""

from __future__ import annotations

import dataclasses
from typing import List

from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import SubqTransformerConfig


def variant_fields() -> List[dataclasses.Field]:
    """The knobs SubqTransformerConfig adds to megatron's TransformerConfig (init fields only)."""
    base = {f.name for f in dataclasses.fields(TransformerConfig)}
    return [f for f in dataclasses.fields(SubqTransformerConfig)
            if f.init and f.name not in base]


def flag_for_field(name: str) -> str:
    return "--" + name.replace("_", "-")
