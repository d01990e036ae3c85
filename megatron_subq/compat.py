"""megatron-core 0.16.1 without Transformer Engine: names it leaves undefined.

``megatron.core.transformer.moe.moe_utils`` imports ``te_general_gemm`` (and the fused MoE ops)
only inside ``try: ... except ImportError``, but its router GEMM then tests
``te_general_gemm is not None`` unconditionally: without TE every MoE router raises
``NameError``. ``install_te_absent_fallbacks()`` defines the missing names as ``None`` (what the
code means by "not available"), on any machine, once; it changes nothing where TE is installed.
"""

from __future__ import annotations

_MOE_TE_NAMES = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
                 "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                 "fused_unpermute")


def install_te_absent_fallbacks() -> None:
    """Define megatron's optional-TE names its MoE code reads unguarded (idempotent)."""
    from megatron.core.transformer.moe import moe_utils  # noqa: PLC0415

    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
