"""The attention slot of any host: which module fills a layer's ``self_attention``, and from what.

``attention_slot_spec(config, n, provider)`` is the ``ModuleSpec`` of layer n's attention slot:
the variant of that layer (``config.layer_variants[n-1]``) builds it from the module classes of
``provider``, a megatron-core spec provider (``megatron/core/models/backends.py``). A host — the
GPT layer of ``specs.py`` today, a hybrid stack's attention slots next — puts it in its own layer
spec around its own norms and MLP. The modules it builds take their process groups from what the
host hands them (megatron's ``pg_collection``), so the slot depends on no particular model.

Providers: ``SubqLocalSpecProvider`` (megatron-core's local linears with this package's norm and
SDPA core attention; runs on the CPU and under sequence parallelism) or megatron's own
``TESpecProvider`` when Transformer Engine is importable; ``get_spec_provider(use_te)`` picks one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from .config import SubqTransformerConfig
from .experts import SubqSequentialMLP
from .norm import FusedLocalNorm, LocalNorm
from .variants import VARIANTS
from .variants.standard import SDPACoreAttention

try:  # Transformer Engine is an optional accelerator
    import transformer_engine  # noqa: F401  (availability probe)

    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    HAVE_TE = True
except ImportError:  # pragma: no cover - depends on the machine
    TESpecProvider = None
    HAVE_TE = False


class SubqLocalSpecProvider(LocalSpecProvider):
    """megatron-core's local modules (column/row-parallel linears, MoE experts), with three of
    this package's own where megatron's local ones do not serve (docs/architecture.md): the
    norm, the core attention and the sequential experts. ``fused_norm``: its norm is
    ``FusedLocalNorm`` (the Triton RMSNorm, ``--subq-fused-norm``)."""

    def __init__(self, fused_norm: bool = False):
        super().__init__()
        self.fused_norm = bool(fused_norm)

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """``LocalNorm``: RMSNorm or LayerNorm per ``config.normalization`` (``rms_norm`` is
        not read); megatron's local ``WrappedTorchNorm`` runs on the CPU but refuses sequence
        parallelism and zero-centred gamma. ``FusedLocalNorm`` with ``fused_norm``."""
        return FusedLocalNorm if self.fused_norm else LocalNorm

    def core_attention(self) -> type:
        """``SDPACoreAttention``: torch SDPA, on the CPU too; megatron's local
        ``DotProductAttention`` allocates on CUDA."""
        return SDPACoreAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool,
                            moe_use_legacy_grouped_gemm: bool):
        """megatron's choice, with ``SubqSequentialMLP`` for its ``SequentialMLP`` (the same
        experts; without autograd the empty ones are skipped: experts.py)."""
        module, submodules = super().grouped_mlp_modules(moe_use_grouped_gemm,
                                                         moe_use_legacy_grouped_gemm)
        return (SubqSequentialMLP if module is SequentialMLP else module), submodules


def get_spec_provider(use_te: Optional[bool] = None, config=None) -> BackendSpecProvider:
    """megatron's ``TESpecProvider`` when ``use_te`` (default: TE importable and CUDA present),
    else ``SubqLocalSpecProvider`` (with the fused norm when ``config.subq_fused_norm``)."""
    fused_norm = bool(getattr(config, "subq_fused_norm", False))
    if use_te is None:
        use_te = HAVE_TE and torch.cuda.is_available()
    if use_te:
        if not HAVE_TE:
            raise ValueError("use_te=True but transformer_engine is not importable; allowed: "
                             "use_te=False or None")
        if fused_norm:
            raise ValueError("subq_fused_norm=True replaces the local spec's norm, but the "
                             "Transformer Engine spec is in use (its norm is fused already); "
                             "allowed: subq_fused_norm=False, or use_te=False")
        return TESpecProvider()
    return SubqLocalSpecProvider(fused_norm=fused_norm)


def check_config(config) -> None:
    """A ``TypeError`` unless ``config`` is a ``SubqTransformerConfig`` (it carries the variant
    of every layer)."""
    if not isinstance(config, SubqTransformerConfig):
        raise TypeError(f"config must be a megatron_subq.SubqTransformerConfig, got "
                        f"{type(config).__name__}")


def check_model_sizes(vocab_size, max_sequence_length) -> None:
    """A ``ValueError`` naming the argument unless both are positive integers (every host's
    builder checks them before building)."""
    for name, value in (("vocab_size", vocab_size), ("max_sequence_length", max_sequence_length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: allowed a positive integer")


def attention_slot_spec(config: SubqTransformerConfig, layer_number: int,
                        provider: Optional[BackendSpecProvider] = None) -> ModuleSpec:
    """The spec of layer ``layer_number``'s attention slot (1-based, global over pipeline
    stages), built by that layer's variant from ``provider``'s modules (default:
    ``get_spec_provider()``)."""
    check_config(config)
    if not 1 <= layer_number <= config.num_layers:
        raise ValueError(f"layer_number={layer_number} is invalid: allowed 1..num_layers="
                         f"{config.num_layers}")
    if provider is None:
        provider = get_spec_provider(config=config)
    name = config.layer_variants[layer_number - 1]
    spec = VARIANTS[name].attention_spec(config, layer_number, provider)
    if config.qk_layernorm:
        spec = _with_qk_norms(spec, config, provider, name)
    return spec


def _with_qk_norms(spec: ModuleSpec, config, provider, name: str) -> ModuleSpec:
    """``config.qk_layernorm`` (Qwen3's per-head q/k norms): the provider's norm in the
    ``q_layernorm``/``k_layernorm`` submodules megatron's ``Attention`` applies before RoPE.
    A slot without those submodules (the Q/K-source variants, mlp) refuses it by name."""
    sub = spec.submodules
    if not all(getattr(sub, n, None) is IdentityOp for n in ("q_layernorm", "k_layernorm")):
        raise ValueError(f"qk_layernorm=True is not supported by the attention variant {name!r} "
                         "(its module has no q/k norm slots); allowed: qk_layernorm=False, or a "
                         "variant built on megatron's SelfAttention")
    norm = provider.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True)
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, q_layernorm=norm, k_layernorm=norm))


__all__ = ["HAVE_TE", "SubqLocalSpecProvider", "attention_slot_spec", "check_config",
           "check_model_sizes", "get_spec_provider"]
