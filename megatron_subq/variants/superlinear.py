"""superlinear: Superlinear multi-step attention (N=2) — its own self-attention module.

Superlinear needs a projection of its own, the search query ``Q_s``, so it is not only a new core:
``SuperlinearSelfAttention`` is megatron's ``SelfAttention`` (fused QKV column-parallel
projection, GQA, RoPE, row-parallel output projection ``linear_proj``) plus ``linear_qs``, a
column-parallel ``hidden -> H * D`` projection whose output heads line up with the query heads.

* TP: ``linear_qs`` is split over TP by output rows exactly like the query part of ``linear_qkv``
  (rank r holds the search queries of its H/N query heads), so the op runs on local heads with no
  communication of its own; its ``sharded_state_dict`` is megatron's ColumnParallelLinear one
  (TP-sharded along dim 0), so checkpoints reshard across TP sizes. With
  ``use_cpu_initialization`` megatron initialises the full master weight and splits it, so TP=N
  starts from TP=1's weights (as for every other linear layer).
* SP: ``linear_qs`` all-gathers the sequence-sharded layer input itself (a second all-gather of
  ``[s, b, hidden]`` per layer beside ``linear_qkv``'s; fusing Q_s into the QKV projection would
  save it at the cost of megatron's QKV layout).
* RoPE: applied to Q and K as in standard attention, and to Q_s with the query's rotation.
  The search score ``Q_s(i) . K(t)`` uses the RoPE'd key (K_a = K, as the paper), so rotating Q_s
  at position i makes the score depend on the relative offset i - t only, like an ordinary
  attention logit; an unrotated Q_s would see the absolute position t of the anchor.
* Init: ``config.init_method``, the scheme of the other query weights (the paper's choice).

Not supported (clear errors): packed sequences, KV-cache inference through megatron's inference
context, attention bias, the output gate, context parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from ..attention import SubqCoreAttention, packed_cu_seqlens
from ..ops import superlinear_attention
from .base import SpecBackend, Variant, knob_error
from .standard import self_attention_spec


def superlinear_knobs(config) -> dict:
    """The op's keyword arguments from the config's ``superlinear_*`` fields."""
    return dict(search_power=config.superlinear_search_power,
                span_power=config.superlinear_span_power, topk=config.superlinear_topk,
                backward_factor=config.superlinear_backward_factor,
                forward_factor=config.superlinear_forward_factor,
                sw_index=config.superlinear_sw_index)


class SuperlinearCoreAttention(SubqCoreAttention):
    """``ops.superlinear_attention`` on this rank's heads; takes the search query as well.
    Packed sequences: the op once per document (the default ``attend_packed``)."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        if self.softmax_scale is not None:
            raise ValueError(f"softmax_scale={self.softmax_scale!r} is invalid for superlinear: "
                             "allowed None (span attention uses 1/sqrt(kv_channels))")

    def attend(self, q, k, v, q_s=None):
        if q_s is None:
            raise ValueError("SuperlinearCoreAttention needs the search query q_s")
        return superlinear_attention(q, q_s, k, v, **superlinear_knobs(self.config),
                                     impl=self.config.subq_impl)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, search_query=None):
        # query, search_query: [s, b, np, hn]; key/value: [s, b, ng, hn] (packed: [t, np, hn])
        if attention_bias is not None:
            raise ValueError("superlinear: attention_bias is not supported")
        if search_query is None or search_query.shape != query.shape:
            raise ValueError("superlinear: search_query must have the query's shape "
                             f"{tuple(query.shape)}, got "
                             f"{None if search_query is None else tuple(search_query.shape)}")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params, q_s=search_query)
        q, q_s, k, v = (x.transpose(0, 1) for x in (query, search_query, key, value))
        out = self.attend(q, k, v, q_s=q_s).transpose(0, 1)  # [s, b, np, hn]
        return out.reshape(out.shape[0], out.shape[1], -1)


@dataclass
class SuperlinearSelfAttentionSubmodules(SelfAttentionSubmodules):
    """megatron's self-attention submodules plus the search-query projection."""

    linear_qs: Union[ModuleSpec, type] = None


class SuperlinearSelfAttention(SelfAttention):
    """Self-attention with a search query: QKV and Q_s projections, RoPE, the op, output proj."""

    def __init__(self, config, submodules: SuperlinearSelfAttentionSubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.causal, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        if submodules.linear_qs is None:
            raise ValueError("SuperlinearSelfAttention: submodules.linear_qs is required")
        self.linear_qs = build_module(
            submodules.linear_qs,
            self.config.hidden_size,
            self.query_projection_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear or self.config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qs",
            tp_group=self.pg_collection.tp,
        )

    def get_search_query(self, hidden_states):
        """[s, b, hidden] -> [s, b, np, hn]: this rank's query heads, the order of ``query``."""
        q_s, _ = self.linear_qs(hidden_states)
        return q_s.view(q_s.shape[0], q_s.shape[1], -1, self.hidden_size_per_attention_head)

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """hidden_states [s, b, hidden] -> (output [s, b, hidden], bias)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("superlinear: megatron's inference context (KV cache) is "
                                      "not supported by this module yet")
        if key_value_states is not None:
            raise ValueError("superlinear: key_value_states (cross attention) is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            raise ValueError(f"superlinear: packed_seq_params.qkv_format="
                             f"{packed_seq_params.qkv_format!r}; allowed: 'thd'")
        if any(x is not None for x in (rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin)):
            raise ValueError("superlinear: precomputed rotary cos/sin (inference) are not supported")

        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        search_query = self.get_search_query(hidden_states)
        cu_seqlens = None
        if packed_seq_params is not None:  # THD as megatron's Attention: [t, 1, ..] -> [t, ..]
            query, key, value, search_query = (x.squeeze(1)
                                               for x in (query, key, value, search_query))
            cu_seqlens = packed_cu_seqlens(packed_seq_params)  # RoPE restarts per document

        no_rope = (self.config.no_rope_freq[self.layer_number - 1]
                   if self.config.no_rope_freq else False)
        if rotary_pos_emb is not None and not no_rope:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb,) * 2
            q_pos_emb, k_pos_emb = rotary_pos_emb
            rope = dict(config=self.config, cu_seqlens=cu_seqlens,
                        cp_group=self.pg_collection.cp)
            query = apply_rotary_pos_emb(query, q_pos_emb, **rope)
            search_query = apply_rotary_pos_emb(search_query, q_pos_emb, **rope)
            key = apply_rotary_pos_emb(key, k_pos_emb, **rope)

        core_out = self.core_attention(query, key, value, attention_mask,
                                       attn_mask_type=self.attn_mask_type,
                                       attention_bias=attention_bias,
                                       packed_seq_params=packed_seq_params,
                                       search_query=search_query)
        if packed_seq_params is not None:
            core_out = core_out.reshape(core_out.shape[0], 1, -1)  # [t, np*hn] -> [t, 1, h]
        return self.linear_proj(core_out)

    def backward_dw(self) -> None:
        super().backward_dw()
        if hasattr(self.linear_qs, "backward_dw"):
            self.linear_qs.backward_dw()


def attention_spec(config, layer_number: int, backend: SpecBackend) -> ModuleSpec:
    return self_attention_spec(SuperlinearCoreAttention, backend, module=SuperlinearSelfAttention,
                               submodules=SuperlinearSelfAttentionSubmodules,
                               linear_qs=backend.column_parallel_linear)


def check_knobs(config) -> None:
    """Ranges of the superlinear_* knobs and the random-context-access rule (whether or not a
    layer uses superlinear)."""
    sp, ssp = config.superlinear_search_power, config.superlinear_span_power
    b, f = config.superlinear_backward_factor, config.superlinear_forward_factor
    if not (isinstance(sp, (int, float)) and 0.0 < sp <= 1.0):
        knob_error("superlinear_search_power", sp, "a number in (0, 1]")
    if not (isinstance(ssp, (int, float)) and 0.0 <= ssp <= 1.0):
        knob_error("superlinear_span_power", ssp, "a number in [0, 1]")
    if not isinstance(config.superlinear_topk, int) or config.superlinear_topk < 1:
        knob_error("superlinear_topk", config.superlinear_topk, "an integer >= 1")
    if b < 0:
        knob_error("superlinear_backward_factor", b, "a number >= 0")
    if f < 0:
        knob_error("superlinear_forward_factor", f, "a number >= 0")
    if not isinstance(config.superlinear_sw_index, int) or config.superlinear_sw_index < 0:
        knob_error("superlinear_sw_index", config.superlinear_sw_index, "an integer >= 0")
    if not config.superlinear_allow_no_random_access:
        if sp + ssp < 1.0 - 1e-12:
            raise ValueError(
                f"superlinear_search_power={sp} + superlinear_span_power={ssp} < 1 breaks random "
                "context access (some keys fall in no span); allowed: search_power + span_power "
                ">= 1, or set superlinear_allow_no_random_access=True")
        if b < 1.0 / sp - 1e-12:
            raise ValueError(
                f"superlinear_backward_factor={b} < "
                f"1/superlinear_search_power={1.0 / sp:g} breaks random context access; allowed: "
                "backward_factor >= 1/search_power, or set superlinear_allow_no_random_access=True")


def validate(config) -> None:
    """Cross-field checks for layers that use superlinear (knob ranges: check_knobs)."""
    if config.attention_output_gate:
        raise ValueError("attention_output_gate=True is invalid with superlinear layers: allowed "
                         "False")
    if config.num_query_groups is not None and \
            config.num_query_groups < config.tensor_model_parallel_size:
        raise ValueError(
            f"num_query_groups={config.num_query_groups} is invalid with superlinear layers: "
            f"allowed >= tensor_model_parallel_size={config.tensor_model_parallel_size}")


def superlinear_pairs(cfg, L: int) -> Tuple[float, float]:
    """(search score evaluations, attended keys) summed over queries, per head.

    Anchors of query i: floor((i+1)^p) candidates minus the floor(w^p) inside the window; top-k
    kept; each kept anchor attends span U window (span ceil(b l) + 1 + ceil(f l), l = ceil(i^p_sp)),
    the union counted as the sum capped at i+1; no anchor -> the window alone."""
    p, psp = cfg.superlinear_search_power, cfg.superlinear_span_power
    b, f, topk = (cfg.superlinear_backward_factor, cfg.superlinear_forward_factor,
                  cfg.superlinear_topk)
    w = cfg.superlinear_window
    i = np.arange(L, dtype=np.float64)
    window = np.minimum(i + 1, w)
    inside = math.floor(w ** p + 1e-9) if w > 0 else 0
    candidates = np.where(i + 1 > w, np.maximum(np.floor((i + 1) ** p + 1e-9) - inside, 0), 0)
    kept = np.minimum(candidates, topk)
    ell = np.ceil(i ** psp)
    span = np.ceil(b * ell) + 1 + np.ceil(f * ell)
    keys = np.where(kept > 0, kept * np.minimum(i + 1, span + window), window)
    return float(candidates.sum()), float(keys.sum())


def core_flops(config, L: int) -> float:
    """The search projection Q_s (hidden -> H*D), the search scores and the attended keys."""
    H, D = config.num_attention_heads, config.kv_channels
    scores, keys = superlinear_pairs(config, L)
    search_projection = 2.0 * L * config.hidden_size * H * D  # Q_s: hidden -> H*D (linear_qs)
    return search_projection + 2.0 * scores * H * D + 4.0 * keys * H * D


VARIANT = Variant(
    name="superlinear",
    summary="Superlinear multi-step attention, N=2: power-law anchor search, top-k spans, gate",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
    knobs=("superlinear_",),
    check_knobs=check_knobs,
    core_flops=core_flops,
)
