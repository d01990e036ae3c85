"""megatron_subq: sub-quadratic and simulated attention variants for Megatron-Core.

Public API::

    SubqTransformerConfig      megatron-core TransformerConfig + variant knobs
    VARIANTS                   name -> Variant registry
    get_gpt_layer_spec, get_gpt_block_spec, build_gpt_model
    ops                        functional [B, T, H, D] attention ops, one per variant
"""

import warnings as _warnings

# megatron-core warns at import about optional accelerators (TE, apex); we say it once in docs.
_warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
_warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

from . import ops  # noqa: E402
from .config import SubqTransformerConfig  # noqa: E402
from .specs import build_gpt_model, get_backend, get_gpt_block_spec, get_gpt_layer_spec  # noqa: E402
from .variants import VARIANTS  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "SubqTransformerConfig",
    "VARIANTS",
    "build_gpt_model",
    "get_backend",
    "get_gpt_block_spec",
    "get_gpt_layer_spec",
    "ops",
]
