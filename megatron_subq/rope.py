"""``--subq-fused-rope``: megatron's own ``apply_rope_fusion`` path, run on this package's Triton
RoPE (``kernels/fused/rope.py``) where Transformer Engine, whose kernel that path calls, is
missing.

megatron-core 0.16.1's ``rope_utils.apply_rotary_pos_emb`` calls the module globals
``fused_apply_rotary_pos_emb`` (``[s, b, h, d]``) and ``fused_apply_rotary_pos_emb_thd``
(packed sequences) when ``config.apply_rope_fusion``; both are TE's functions, ``None`` without
TE, and ``TransformerConfig`` refuses ``apply_rope_fusion`` while they are. ``install_fused_rope``
fills the globals that are ``None`` with the functions below (same signatures), so megatron's
attention modules (every variant built on ``SelfAttention``) and its config check run
unchanged; with TE present nothing is replaced and megatron uses TE's kernel. Megatron reads the
globals only for configs with ``apply_rope_fusion``, so installing them changes nothing else.
``SubqTransformerConfig(subq_fused_rope=True)`` installs them and sets ``apply_rope_fusion``.
"""

from __future__ import annotations

import torch


def fused_rope_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False
                    ) -> torch.Tensor:
    """TE's ``fused_apply_rotary_pos_emb`` signature: ``t`` ``[s, b, h, d]``, ``freqs``
    ``[s, 1, 1, r]``. CPU tensors outside the interpreter take megatron's unfused function."""
    from megatron.core.models.common.embeddings import rope_utils  # noqa: PLC0415

    from .kernels.checks import triton_runs_on  # noqa: PLC0415

    if interleaved or not triton_runs_on(t):
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    from .kernels.fused import rope_kernel  # noqa: PLC0415 (Triton loads on first use)

    return rope_kernel(t, freqs)


def fused_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                   cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """TE's ``fused_apply_rotary_pos_emb_thd`` signature: packed ``t`` ``[T, h, d]``. The
    per-document positions are megatron's (``_apply_rotary_pos_emb_thd``: its
    ``_get_thd_freqs_on_this_cp_rank`` per document, with offsets when ``freqs`` covers every
    packed token), then one kernel call on all tokens."""
    from megatron.core.models.common.embeddings import rope_utils  # noqa: PLC0415

    seqlens = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()
    parts = torch.split(t, seqlens)
    exact = freqs.size(0) == cu_seqlens[-1]
    freqs_packed = torch.cat([
        rope_utils._get_thd_freqs_on_this_cp_rank(
            cp_rank, cp_size, x, freqs, *((cu_seqlens[i].item(),) if exact else ()))
        for i, x in enumerate(parts)], dim=0)
    return fused_rope_bshd(t.unsqueeze(1), freqs_packed).squeeze(1)


def install_fused_rope() -> None:
    """Fill megatron's missing fused-RoPE globals (idempotent; TE's functions are kept)."""
    from megatron.core.models.common.embeddings import rope_utils  # noqa: PLC0415

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_rope_thd


__all__ = ["fused_rope_bshd", "fused_rope_thd", "install_fused_rope"]
