"""Functional attention ops, one per variant, all in the ``[B, T, H, D]`` layout of flash-attn / fla.

Each op takes ``impl="reference" | "kernel" | None`` (see ``dispatch.choose_impl``). The reference
is plain PyTorch written to be read beside the paper; kernels live in ``megatron_subq.kernels``.
"""

from .dispatch import IMPLS, choose_impl, repeat_kv
from .standard import standard_attention

__all__ = ["IMPLS", "choose_impl", "repeat_kv", "standard_attention"]
