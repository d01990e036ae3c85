"""The shared core-attention module: Megatron's ``[s, b, h, d]`` on one side, an op on the other.

A variant that only changes the attention core subclasses ``SubqCoreAttention`` and implements
``attend(q, k, v)`` on ``[B, T, H, D]`` tensors (the layout of ``megatron_subq.ops``); the layout
conversion, the causal-only check and the TP head bookkeeping live here once. Such a module plugs
into megatron's ``SelfAttention`` as ``core_attention`` (GPTModel, and MambaStack's attention
slot, alike).

Masks: every variant is causal by definition, so the causal ``attention_mask`` that megatron
passes is implied and not read. Packed sequences (``packed_seq_params``, THD) are refused with a
clear error until the kernels' ``cu_seqlens`` support lands.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .parallel import local_heads, sharded_state_dict_with_head_params


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
        if config.context_parallel_size > 1:
            raise ValueError("context_parallel_size > 1 is not supported by megatron_subq's "
                             "attention variants yet; allowed: 1")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.num_heads = config.num_attention_heads
        self.num_heads_local = local_heads(config.num_attention_heads, "num_attention_heads")
        self.head_dim = config.kv_channels

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H_local, D], k/v: [B, T, H_kv_local, D] -> [B, T, H_local, D]."""
        raise NotImplementedError

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # query: [s, b, np, hn]; key/value: [s, b, ng, hn]
        if packed_seq_params is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: packed sequences (packed_seq_params) are not supported yet")
        if attention_bias is not None:
            raise ValueError(f"{type(self).__name__}: attention_bias is not supported")
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
        out = self.attend(q, k, v)  # [b, s, np, hn]
        out = out.transpose(0, 1)  # [s, b, np, hn]
        return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, np*hn]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        return sharded_state_dict_with_head_params(self, prefix, sharded_offsets, metadata)
