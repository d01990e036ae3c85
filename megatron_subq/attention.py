"""The shared core-attention module: Megatron's ``[s, b, h, d]`` on one side, an op on the other.

A variant that only changes the attention core subclasses ``SubqCoreAttention`` and implements
``attend(q, k, v)`` on ``[B, T, H, D]`` tensors (the layout of ``megatron_subq.ops``); the layout
conversion, the causal-only check and the TP head bookkeeping live here once. Such a module plugs
into megatron's ``SelfAttention`` as ``core_attention`` (GPTModel, and MambaStack's attention
slot, alike).

Process groups: megatron's ``SelfAttention`` hands its ``pg_collection`` to the core; the core
keeps it (``self.pg_collection``, ``self.tp_group``) and gives ``tp_group`` to what it builds
(head-sharded parameters, SAS's head gather). Built without one (a test, a script), it takes
megatron's global groups (``parallel.process_groups``).

Masks: every variant is causal by definition, so the causal ``attention_mask`` that megatron
passes is implied and not read. Packed sequences (megatron's ``packed_seq_params`` in the THD
layout: one row of documents back to back, ``cu_seqlens`` marking where each starts) run each
document as its own causal sequence: through the op's own ``cu_seqlens`` (asa, ppa) or one
``attend`` per document (the default ``attend_packed``; every variant is causal per sequence).
Which variants take them is the registry's ``Variant.packed_sequences``; the Q/K-source variants,
the only ones that do not, refuse them in their own attention and model.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_pg_size

from .parallel import local_heads, process_groups, sharded_state_dict_with_head_params


class SubqCoreAttention(MegatronModule):
    """Base of every variant's core attention. Subclasses implement ``attend``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"{type(self).__name__}: attn_mask_type={attn_mask_type} is not "
                             "supported; allowed: causal (every variant is causal attention)")
        if attention_type != "self":
            raise ValueError(f"{type(self).__name__}: attention_type={attention_type!r}; "
                             "allowed: 'self'")
        self.pg_collection = process_groups(pg_collection)
        self.tp_group = self.pg_collection.tp
        cp = max(get_pg_size(getattr(self.pg_collection, "cp", None)),
                 config.context_parallel_size)
        if cp > 1 and config.layer_variant(layer_number).context_parallel == "none":
            raise ValueError(f"context_parallel_size={cp} is not supported by megatron_subq's "
                             "attention variants yet; allowed: 1")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.num_heads = config.num_attention_heads
        self.num_heads_local = local_heads(config.num_attention_heads, "num_attention_heads",
                                           tp_group=self.tp_group)
        self.head_dim = config.kv_channels

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H_local, D], k/v: [B, T, H_kv_local, D] -> [B, T, H_local, D]."""
        raise NotImplementedError

    def attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed sequences: q [1, T, H_local, D], k/v [1, T, H_kv_local, D], ``cu_seqlens``
        ``[0, end_1, ..., T]`` -> [1, T, H_local, D], each document causal on its own. This
        default runs ``attend`` once per document; ops that take ``cu_seqlens`` override it."""
        bounds = cu_seqlens.tolist()
        outs = [self.attend(q[:, a:b], k[:, a:b], v[:, a:b])
                for a, b in zip(bounds, bounds[1:]) if b > a]
        return torch.cat(outs, dim=1)

    def _forward_packed(self, query, key, value, packed_seq_params):
        name = type(self).__name__
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"{name}: packed_seq_params.qkv_format="
                             f"{packed_seq_params.qkv_format!r}; allowed: 'thd'")
        cu = packed_cu_seqlens(packed_seq_params)
        if cu is None:
            raise ValueError(f"{name}: packed sequences need packed_seq_params.cu_seqlens_q")
        # self-attention: the key boundaries are the query ones (not compared: that would sync)

        def row(x):  # megatron's THD [t, np, hn] (batch squeezed; [t, 1, np, hn] too) -> [1, t, ..]
            return x.squeeze(1).unsqueeze(0) if x.dim() == 4 else x.unsqueeze(0)

        out = self.attend_packed(row(query), row(key), row(value), cu)[0]  # [t, np, hn]
        return out.reshape(out.shape[0], -1)  # [t, np*hn]: megatron adds the batch dim back

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # query: [s, b, np, hn]; key/value: [s, b, ng, hn] (packed: [t, np, hn], see above)
        if attention_bias is not None:
            raise ValueError(f"{type(self).__name__}: attention_bias is not supported")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params)
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
        out = self.attend(q, k, v)  # [b, s, np, hn]
        out = out.transpose(0, 1)  # [s, b, np, hn]
        return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, np*hn]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        return sharded_state_dict_with_head_params(self, prefix, sharded_offsets, metadata)


def packed_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The document boundaries of megatron's THD ``packed_seq_params`` (padded ones if given)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu
