"""megatron_subq: sub-quadratic and simulated attention variants for Megatron-Core.

Public API::

    SubqTransformerConfig      megatron-core TransformerConfig + variant knobs
    VARIANTS                   name -> Variant registry
    Variant, register_variant  one variant as a unit; add one at run time (a plugin)
    attention_slot_spec        the attention slot of one layer, for any host
    get_spec_provider          megatron's spec provider: TE's, or local modules + our norm/SDPA
    get_gpt_layer_spec, get_gpt_block_spec, build_gpt_model   the GPT host
    build_hybrid_model, hybrid_preset   the hybrid Mamba-2 + MoE host (docs/hybrid.md)
    init_single_process        one-process torch.distributed + megatron parallel state
    ops                        functional [B, T, H, D] attention ops, one per variant
"""

import importlib as _importlib
import importlib.util as _importlib_util
import os as _os
import sys as _sys
import warnings as _warnings


def _expose_source_kernels() -> None:
    """Make ``megatron_subq.kernels`` importable from a source checkout too.

    Installed (setup.py's ``package_dir``, editable or not), the top-level ``kernels/`` folder *is*
    ``megatron_subq.kernels``. Run from a checkout without installing — the examples and tools put
    the repository root first on ``sys.path`` — the package is this folder alone and the ops would
    silently fall back to their PyTorch references on CUDA. Register the sibling folder under the
    installed name instead (``kernels/__init__.py`` imports nothing, so this costs nothing)."""
    name = __name__ + ".kernels"
    if name in _sys.modules or _importlib_util.find_spec(name) is not None:
        return
    init = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))),
                         "kernels", "__init__.py")
    if not _os.path.isfile(init):
        return
    spec = _importlib_util.spec_from_file_location(
        name, init, submodule_search_locations=[_os.path.dirname(init)])
    module = _importlib_util.module_from_spec(spec)
    _sys.modules[name] = module
    spec.loader.exec_module(module)


_expose_source_kernels()

# megatron-core warns at import about optional accelerators (TE, apex); we say it once in docs.
_warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
_warnings.filterwarnings("ignore", message=".*Apex is not installed.*")

from . import ops  # noqa: E402
from .config import SubqTransformerConfig  # noqa: E402
from .initialize import destroy_single_process, init_single_process  # noqa: E402
from .slots import attention_slot_spec, get_spec_provider  # noqa: E402
from .specs import build_gpt_model, get_gpt_block_spec, get_gpt_layer_spec  # noqa: E402
from .variants import VARIANTS, Variant, register_variant  # noqa: E402

__version__ = "0.1.0"

_LAZY = {"build_hybrid_model": "hybrid", "hybrid_preset": "hybrid"}


def __getattr__(name: str):
    """The hybrid host's entry points, imported on first use: megatron's Mamba modules pull in
    triton (its inference contexts), which the package itself does not need to import."""
    if name in _LAZY:
        module = _importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "SubqTransformerConfig",
    "VARIANTS",
    "Variant",
    "attention_slot_spec",
    "build_gpt_model",
    "build_hybrid_model",
    "destroy_single_process",
    "get_gpt_block_spec",
    "get_gpt_layer_spec",
    "get_spec_provider",
    "hybrid_preset",
    "init_single_process",
    "ops",
    "register_variant",
]
