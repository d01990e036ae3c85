"""Mamba-2 for the hybrid host: megatron-core's ``MambaMixer`` where its kernels run, else
``SubqMambaMixer`` (plain PyTorch, same parameters and checkpoints).

``mamba_mixer_class(config, impl)`` is the one place that decides (docs/hybrid.md).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .mamba_mixer import GatedRMSNorm, MambaMixerSubmodules, SubqMambaMixer

MAMBA_MIXER_IMPLS = ("auto", "megatron", "pytorch")


def megatron_mamba_mixer_usable(config=None) -> Tuple[bool, str]:
    """(whether megatron's ``MambaMixer`` can train here, why not). It needs CUDA, ``mamba_ssm``
    (its Triton SSD kernels and gated norm) and einops; its default memory-efficient path
    (``config.use_mamba_mem_eff_path``, True when no config is given) also needs
    ``causal_conv1d``'s CUDA conv."""
    from megatron.core.ssm import mamba_mixer as mm  # noqa: PLC0415

    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if not mm.HAVE_MAMBA_SSM:
        return False, "mamba_ssm is not importable"
    if not mm.HAVE_EINOPS:
        return False, "einops is not importable"
    mem_eff = True if config is None else bool(getattr(config, "use_mamba_mem_eff_path", True))
    if mem_eff and mm.causal_conv1d_fn is None:
        return False, ("causal_conv1d is not importable, and use_mamba_mem_eff_path=True "
                       "(megatron's fused path) needs it")
    return True, ""


def mamba_mixer_class(config=None, impl: Optional[str] = None) -> type:
    """The mixer class for a ``MambaLayerSubmodules(mixer=ModuleSpec(<class>, ...))`` spec.

    ``impl``: ``"auto"`` (default, also for None) picks megatron's ``MambaMixer`` when
    ``megatron_mamba_mixer_usable(config)`` (CUDA, mamba_ssm, and causal_conv1d unless
    ``config.use_mamba_mem_eff_path`` is False), else ``SubqMambaMixer``; ``"pytorch"`` forces
    ``SubqMambaMixer``; ``"megatron"`` forces megatron's and fails here, naming what is missing,
    where it cannot run. Both have the same parameters and checkpoint keys.
    """
    impl = "auto" if impl is None else impl
    if impl not in MAMBA_MIXER_IMPLS:
        raise ValueError(f"mamba_mixer_class: impl={impl!r} is invalid: allowed "
                         f"{MAMBA_MIXER_IMPLS} or None")
    if impl == "pytorch":
        return SubqMambaMixer
    usable, why = megatron_mamba_mixer_usable(config)
    if impl == "megatron" and not usable:
        raise ValueError(f"mamba_mixer_class: impl='megatron' is unusable here: {why}; allowed "
                         "'pytorch' or 'auto'")
    if not usable:
        return SubqMambaMixer
    from megatron.core.ssm.mamba_mixer import MambaMixer  # noqa: PLC0415

    return MambaMixer


__all__ = ["GatedRMSNorm", "MAMBA_MIXER_IMPLS", "MambaMixerSubmodules", "SubqMambaMixer",
           "mamba_mixer_class", "megatron_mamba_mixer_usable"]
