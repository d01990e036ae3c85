"""Self-attention whose Q and K come from another stream than V (the deconstructed QK variants).

``rnd_emb_qk`` / ``fixed_seq_qk``: Q, K from the hidden state of a *fixed input* (random ε or the
embedding of a fixed text) at this layer, one row shared by the whole batch; ``static_emb_qk``:
Q, K from the sample's own token embeddings (the embedding output before layer 1). V always comes
from the layer's input. Where the Q/K source lives is the host layer's business
(``megatron_subq.model.StreamTransformerLayer`` carries it along the batch dimension); the host
hands it to this module for one forward with ``use_qk_source``:

* ``QKSource(row=r)``: row r of this module's own (normed) input is the fixed input; its Q, K
  give the one map every row uses (the fixed row itself included, which is then ordinary
  self-attention: the fixed input runs through the layer like any input).
* ``QKSource(hidden=x)``: a separate ``[s, b, h]`` tensor (already through the layer's input
  norm), one Q/K row per sample.

Projections: ``linear_qk`` (Q and K, laid out per query group ``[ng, (np/ng + 1)·hn]`` so that a
contiguous TP split hands each rank whole groups, as megatron's fused QKV does) and ``linear_v``
(``[ng·hn]``). Together they hold exactly the weights of standard attention's ``linear_qkv``
(parameter-matched, as the paper requires), while only the rows that are used get projected:
Q, K of the source, V of the input — no Q/K GEMM is wasted on the B input rows of a fixed-row
variant. RoPE, GQA, the row-parallel output projection and SP come from megatron's ``Attention``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from ..attention import SubqCoreAttention
from ..ops import shared_map_attention


@dataclass
class QKSourceAttentionSubmodules:
    linear_qk: Union[ModuleSpec, type] = None
    linear_v: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


@dataclass(frozen=True)
class QKSource:
    """Where Q and K come from in one forward: a shared ``row`` of the input, or ``hidden``."""

    row: Optional[int] = None
    hidden: Optional[torch.Tensor] = None

    def __post_init__(self):
        if (self.row is None) == (self.hidden is None):
            raise ValueError("QKSource: give exactly one of row= (a shared fixed row of the input) "
                             "or hidden= (a [s, b, h] tensor)")


class SharedMapCoreAttention(SubqCoreAttention):
    """q, k of batch 1 (the fixed row), v of batch B: one causal softmax map for every row."""

    def attend(self, q, k, v):
        return shared_map_attention(q, k, v, causal=True, scale=self.softmax_scale,
                                    impl=self.config.subq_impl)


class QKSourceAttention(Attention):
    """megatron ``Attention`` with Q, K from ``QKSource`` and V from the layer input."""

    def __init__(self, config, submodules: QKSourceAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, attention_type="self",
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if config.num_query_groups < self.world_size:
            raise ValueError(f"num_query_groups={config.num_query_groups} is invalid for the QK-"
                             "source variants: allowed a multiple of tensor_model_parallel_size="
                             f"{self.world_size}")
        common = dict(config=config, init_method=config.init_method, gather_output=False,
                      bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                      is_expert=False, tp_group=self.pg_collection.tp)
        self.linear_qk = build_module(submodules.linear_qk, config.hidden_size,
                                      self.query_projection_size + self.kv_projection_size,
                                      **common)
        self.linear_v = build_module(submodules.linear_v, config.hidden_size,
                                     self.kv_projection_size, **common)
        self.q_layernorm = self.k_layernorm = None  # read by megatron's Attention.forward
        self._qk_source: Optional[QKSource] = None

    @contextlib.contextmanager
    def use_qk_source(self, source: QKSource):
        """Hand this module its Q/K source for the forward calls inside the ``with``."""
        previous, self._qk_source = self._qk_source, source
        try:
            yield
        finally:
            self._qk_source = previous

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                *args, **kwargs):
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError(f"{type(self).__name__}: KV-cache inference is not "
                                      "implemented for the QK-source variants (docs/variants.md)")
        if kwargs.get("packed_seq_params") is not None:
            raise NotImplementedError(
                f"{type(self).__name__}: packed sequences (packed_seq_params) are not supported by "
                "this variant (its fixed Q/K rows belong to a whole micro-batch)")
        return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                               *args, **kwargs)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate: bool = False, split_qkv: bool = True):
        """hidden_states ``[s, b, h]`` (normed) -> q ``[s, b_qk, np, hn]``, k ``[s, b_qk, ng, hn]``,
        v ``[s, b, ng, hn]``; b_qk is 1 for a shared row, b for a per-sample source."""
        if key_value_states is not None or output_gate or not split_qkv:
            raise ValueError(f"{type(self).__name__}: cross attention, attention_output_gate and "
                             "fused_single_qkv_rope are not supported; allowed: self-attention")
        source = self._qk_source
        if source is None:
            raise RuntimeError(
                f"{type(self).__name__} (layer {self.layer_number}) was called without a Q/K "
                "source: it must sit in a megatron_subq.model.StreamTransformerLayer (build the "
                "model with megatron_subq.build_gpt_model)")
        if source.row is not None:
            qk_input = hidden_states[:, source.row:source.row + 1].contiguous()
        else:
            qk_input = source.hidden
            if qk_input.shape[:2] != hidden_states.shape[:2]:
                raise ValueError(f"QKSource.hidden has shape {tuple(qk_input.shape)}; allowed: the "
                                 f"[s, b] of the attention input {tuple(hidden_states.shape[:2])}")
        qk, _ = self.linear_qk(qk_input)
        value, _ = self.linear_v(hidden_states)

        ng, hn = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        heads_per_group = self.num_attention_heads_per_partition // ng
        qk = qk.view(*qk.shape[:2], ng, (heads_per_group + 1) * hn)
        query, key = torch.split(qk, [heads_per_group * hn, hn], dim=3)
        query = query.reshape(*query.shape[:2], -1, hn)          # [s, b_qk, np, hn]
        value = value.view(*value.shape[:2], ng, hn)              # [s, b, ng, hn]
        return query, key, value

    def backward_dw(self) -> None:
        """Delayed weight-gradient computation (TE's ``delay_wgrad_compute``)."""
        self.linear_qk.backward_dw()
        self.linear_v.backward_dw()
        self.linear_proj.backward_dw()


def qk_source_attention_spec(core_attention: type, provider: BackendSpecProvider) -> ModuleSpec:
    """``QKSourceAttention`` around ``core_attention``, its linears from ``provider``."""
    return ModuleSpec(
        module=QKSourceAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=QKSourceAttentionSubmodules(
            linear_qk=provider.column_parallel_linear(),
            linear_v=provider.column_parallel_linear(),
            core_attention=core_attention,
            linear_proj=provider.row_parallel_linear(),
        ),
    )


def validate_qk_source_config(config, name: str) -> None:
    """Checks shared by the three variants (``name`` is the variant, for the messages)."""
    tp = config.tensor_model_parallel_size
    if config.num_query_groups % tp:
        raise ValueError(f"num_query_groups={config.num_query_groups} is invalid with {name} "
                         f"layers: allowed a multiple of tensor_model_parallel_size={tp}")
    for field_name in ("attention_output_gate", "fused_single_qkv_rope", "multi_latent_attention",
                       "tp_comm_overlap"):
        if getattr(config, field_name, False):
            raise ValueError(f"{field_name}=True is invalid with {name} layers: allowed False")
    if config.pipeline_model_parallel_size > 1:
        # The Q/K streams ride along the batch dimension of the hidden states, so the tensor sent
        # between pipeline stages is [s, b + extra, h] rather than the [s, b, h] the schedules
        # assume: let megatron's p2p communicate the shape first (model.py explains).
        config.variable_seq_lengths = True
