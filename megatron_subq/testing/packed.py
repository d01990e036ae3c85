"""Packed-sequence checks: a GPT run on documents packed into one THD row must give each
document exactly the per-token losses it gets alone (no token sees another document)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from ..config import SubqTransformerConfig
from ..specs import build_gpt_model
from .equivalence import TINY


def packed_seq_params(lengths, device=None) -> PackedSeqParams:
    """Megatron's THD parameters for documents of these lengths packed back to back."""
    cu = torch.tensor([0] + list(lengths), dtype=torch.int32, device=device).cumsum(0)
    cu = cu.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def packed_vs_separate_losses(cfg_kwargs: dict, lengths=(10, 14), vocab: int = 128,
                              seed: int = 0) -> dict:
    """Per-token losses of the documents packed (THD, one row) and run one by one, with the same
    weights, under the current parallel state (call inside a rank)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = SubqTransformerConfig(**{**TINY, **cfg_kwargs, "tensor_model_parallel_size": tp})
    total = sum(lengths)
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=total)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (1, n + 1), generator=g) for n in lengths]
    with torch.no_grad():
        separate = []
        for doc in docs:
            n = doc.shape[1] - 1
            pos = torch.arange(n).unsqueeze(0)
            separate.append(model(doc[:, :-1], pos, None, labels=doc[:, 1:]))
        tokens = torch.cat([d[:, :-1] for d in docs], dim=1)
        labels = torch.cat([d[:, 1:] for d in docs], dim=1)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        packed = model(tokens, pos, None, labels=labels,
                       packed_seq_params=packed_seq_params(lengths))
    return {"packed": packed.float(), "separate": torch.cat(separate, dim=1).float()}
