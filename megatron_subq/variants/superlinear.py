"""superlinear: Superlinear multi-step attention (N=2) — its own self-attention module.

Superlinear needs a projection of its own, the search query ``Q_s``, so it is not only a new core:
``SuperlinearSelfAttention`` is megatron's ``SelfAttention`` (fused QKV column-parallel
projection, GQA, RoPE, row-parallel output projection ``linear_proj``) plus ``linear_qs``, a
column-parallel ``hidden -> H * D`` projection whose output heads line up with the query heads.

* Route: ``get_query_key_value_tensors`` appends this rank's search queries to its query heads
  (``query`` is ``[s, b, 2·np, hn]``: the np query heads, then their np search queries), so
  megatron's own ``SelfAttention.forward`` applies the query's RoPE to both, handles packed (THD)
  sequences and recompute, and hands them to ``SuperlinearCoreAttention``, which splits them in
  ``attend`` after ``SubqCoreAttention``'s one ``[s, b, h, d]`` -> ``[B, T, H, D]`` conversion.
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

* Decoding: a KV cache (K is also the search key, so nothing else is kept), the chunks through
  ``ops.superlinear_prefill`` and single tokens through ``ops.superlinear_decode_step`` (O(√L)
  keys read per token at p = 1/2); the inference context reaches the core through
  ``SubqSelfAttention``, which this module extends. With ``superlinear_decode_graph`` the
  one-token step runs through a ``SuperlinearDecodePlan`` instead, captured in a CUDA graph per
  layer and capacity bucket (``DecodeStepGraph``): only the core's step is captured, the
  projections, the cache write and the rest of the model stay eager.

Not supported (clear errors): cross attention, attention bias, the output gate, the fused QKV
RoPE. Context parallelism: the shared
all-to-all path (``SubqCoreAttention``), the search queries riding along their query heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np

import torch
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from ..attention import KVCache, SubqCoreAttention
from ..ops import superlinear_attention, superlinear_decode_step, superlinear_prefill
from ..ops.dispatch import choose_impl
from .base import Variant, knob_error
from .standard import SubqSelfAttention, self_attention_spec


def superlinear_knobs(config) -> dict:
    """The op's keyword arguments from the config's ``superlinear_*`` fields."""
    return dict(search_power=config.superlinear_search_power,
                span_power=config.superlinear_span_power, topk=config.superlinear_topk,
                backward_factor=config.superlinear_backward_factor,
                forward_factor=config.superlinear_forward_factor,
                sw_index=config.superlinear_sw_index)


class DecodeStepGraph:
    """One superlinear layer's one-token decode step at every length of one capacity bucket
    ``(C/2, C]``: a ``SuperlinearDecodePlan`` and, with ``capture`` (CUDA), a CUDA graph of its
    launches, captured at the first step of the bucket and replayed at the others.

    Static inputs: ``query`` ``[B, 2·np, D]`` (the step's query heads, then their search
    queries; ``run`` copies the new token's into it, one copy) and the layer's KV cache
    tensors, allocated once per decode session (``max_length`` rows; the new token's key and
    value are written into them eagerly before ``run``). ``run`` writes the step's integers into
    the plan's device buffer (``set_length``), then replays (or, without capture, launches the
    plan's kernels) and returns the plan's static output ``[B, np, D]``: valid until this
    layer's next step (the model consumes it at once). Equal to ``superlinear_decode_step``'s
    kernel at the same length bitwise (the plan's guarantee)."""

    def __init__(self, query: torch.Tensor, cache: KVCache, capacity: int, knobs: dict,
                 capture: bool):
        from ..kernels.superlinear import SuperlinearDecodePlan  # noqa: PLC0415 (Triton)

        B, two_np, D = query.shape
        np_ = two_np // 2
        self.capacity, self.capture = capacity, capture
        self.query = torch.empty(B, two_np, D, dtype=query.dtype, device=query.device)
        self.q, self.q_s = self.query[:, :np_], self.query[:, np_:]
        self.k, self.v = cache.k, cache.v
        self.plan = SuperlinearDecodePlan(B, np_, cache.k.shape[2], D, capacity, query.dtype,
                                          query.device, **knobs)
        self.graph = None
        self.replays = 0

    def _launch(self) -> torch.Tensor:
        return self.plan.run(self.q, self.q_s, self.k, self.v)

    def run(self, query: torch.Tensor, length: int) -> torch.Tensor:
        """The step of the query at position ``length - 1`` (``query`` ``[B, 2·np, D]``) over
        cache positions ``[0, length)``."""
        self.query.copy_(query)
        self.plan.set_length(length)
        if not self.capture:
            return self._launch()
        if self.graph is None:
            from ..cuda_graphs import capture_cuda_graph  # noqa: PLC0415

            self.graph, _ = capture_cuda_graph(self._launch)
        self.graph.replay()
        self.replays += 1
        return self.plan.out


@dataclass
class SuperlinearKVCache(KVCache):
    """The layer's KV cache plus its current ``DecodeStepGraph`` (``superlinear_decode_graph``;
    None until the first planned step, replaced when the length enters the next capacity
    bucket). A new decode session builds a new cache, and so drops the captured step."""

    decode_step: Optional[DecodeStepGraph] = None


class SuperlinearCoreAttention(SubqCoreAttention):
    """``ops.superlinear_attention`` on this rank's heads.

    Its ``query`` carries the search queries after the query heads (``[.., 2·np, hn]``, as
    ``SuperlinearSelfAttention`` builds it); ``attend`` splits them. Packed sequences: the op
    once per document (the default ``attend_packed``). Under context parallelism the search
    queries stay with their query heads (``query_head_stacks = 2``)."""

    query_head_stacks = 2

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        if self.softmax_scale is not None:
            raise ValueError(f"softmax_scale={self.softmax_scale!r} is invalid for superlinear: "
                             "allowed None (span attention uses 1/sqrt(kv_channels))")
        # superlinear_decode_graph's bookkeeping (tests and tools/bench_decode.py read it): CUDA
        # graphs captured, and one-token steps run through a plan (captured or not)
        self.decode_graph_captures = 0
        self.decode_plan_steps = 0

    def _split(self, q):
        np_ = self.num_heads_local
        if q.shape[2] != 2 * np_:
            raise ValueError(f"SuperlinearCoreAttention: the query must carry {np_} query heads "
                             f"and then their {np_} search_query heads ({2 * np_} in all), got "
                             f"{q.shape[2]}")
        return q[:, :, :np_], q[:, :, np_:]

    def attend(self, q, k, v):
        """q: [B, T, 2·np, D] (query heads, then the search queries q_s), k/v: [B, T, ng, D]."""
        q, q_s = self._split(q)
        return superlinear_attention(q, q_s, k, v, **superlinear_knobs(self.config),
                                     impl=self.config.subq_impl)

    def new_decode_cache(self, q, k, v, max_length):
        return SuperlinearKVCache.like(k, v, max_length)

    def decode_step_mode(self, q: torch.Tensor) -> Optional[str]:
        """How a one-token step runs: None (``superlinear_decode_step``, eager), 'plan' (a
        ``SuperlinearDecodePlan`` uncaptured: the CPU, Triton's interpreter) or 'graph' (the plan
        in a CUDA graph). The plan only with ``superlinear_decode_graph`` and where the op would
        run its kernel (CUDA, or ``subq_impl='kernel'`` on the CPU); the interpreter has no
        bf16, so bf16 on the CPU stays eager (the eager kernel computes it on fp32 copies)."""
        if not self.config.superlinear_decode_graph:
            return None
        from ..ops.superlinear import _decode_kernel  # noqa: PLC0415

        if choose_impl("superlinear_decode_step", self.config.subq_impl, (q,),
                       _decode_kernel()) != "kernel":
            return None
        if q.is_cuda:
            return "graph"
        return None if q.dtype == torch.bfloat16 else "plan"

    def _planned_step(self, query, cache, end: int, capture: bool):
        """query ``[B, 2·np, D]`` -> ``[B, np, D]`` through the cache's ``DecodeStepGraph`` of
        ``end``'s capacity bucket (a new one, captured at its first step, on entering it)."""
        from ..kernels.superlinear.plan import capacity_bucket  # noqa: PLC0415

        capacity = capacity_bucket(end)
        step = cache.decode_step
        if step is None or step.capacity != capacity or step.capture != capture:
            cache.decode_step = None  # the old bucket's buffers and graph go first
            step = cache.decode_step = DecodeStepGraph(query, cache, capacity,
                                                       superlinear_knobs(self.config), capture)
            self.decode_graph_captures += capture
        self.decode_plan_steps += 1
        return step.run(query, end)

    def attend_cached(self, q, k, v, cache, start):
        """One token: ``superlinear_decode_step`` (O(√L) cache rows read), or its plan (captured
        on CUDA) with ``superlinear_decode_graph`` (``decode_step_mode``); a chunk:
        ``superlinear_prefill``. Each reads the cache buffers up to the chunk's end only."""
        query = q
        q, q_s = self._split(q)
        end = start + q.shape[1]
        cache.append(k, v, start)
        knobs = dict(superlinear_knobs(self.config), impl=self.config.subq_impl)
        if q.shape[1] == 1:
            mode = self.decode_step_mode(q)
            if mode is not None and isinstance(cache, SuperlinearKVCache):
                return self._planned_step(query[:, 0], cache, end, mode == "graph")[:, None]
            return superlinear_decode_step(q[:, 0], q_s[:, 0], cache.k, cache.v, length=end,
                                           **knobs)[:, None]
        return superlinear_prefill(q, q_s, cache.k[:, :end], cache.v[:, :end], start=start,
                                   **knobs)


@dataclass
class SuperlinearSelfAttentionSubmodules(SelfAttentionSubmodules):
    """megatron's self-attention submodules plus the search-query projection."""

    linear_qs: Union[ModuleSpec, type] = None


class SuperlinearSelfAttention(SubqSelfAttention):
    """``SubqSelfAttention`` (megatron's) with the search-query projection ``linear_qs``: its
    forward is megatron's; the search queries ride along the query heads (module docstring)."""

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

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate: bool = False, split_qkv: bool = True):
        """megatron's q, k, v, with the search queries appended to the query heads:
        q ``[s, b, 2·np, hn]``, k/v ``[s, b, ng, hn]``."""
        if key_value_states is not None or output_gate or not split_qkv:
            raise ValueError("superlinear: cross attention, attention_output_gate and "
                             "fused_single_qkv_rope are not supported; allowed: self-attention "
                             "with separate q, k, v")
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        return torch.cat([query, self.get_search_query(hidden_states)], dim=2), key, value

    def forward(self, hidden_states, attention_mask, key_value_states=None,
                inference_context=None, *args, inference_params=None, **kwargs):
        """megatron's ``SelfAttention.forward``, refusing what the module does not support."""
        if key_value_states is not None:
            raise ValueError("superlinear: key_value_states (cross attention) is not supported")
        return super().forward(hidden_states, attention_mask, None,
                               inference_context if inference_context is not None
                               else inference_params, *args, **kwargs)

    def backward_dw(self) -> None:
        super().backward_dw()
        if hasattr(self.linear_qs, "backward_dw"):
            self.linear_qs.backward_dw()


def attention_spec(config, layer_number: int, provider) -> ModuleSpec:
    return self_attention_spec(SuperlinearCoreAttention, provider, module=SuperlinearSelfAttention,
                               submodules=SuperlinearSelfAttentionSubmodules,
                               linear_qs=provider.column_parallel_linear())


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
    if not isinstance(config.superlinear_decode_graph, bool):
        knob_error("superlinear_decode_graph", config.superlinear_decode_graph, "True or False")
    if config.superlinear_decode_graph and config.subq_impl == "reference":
        raise ValueError("superlinear_decode_graph=True is invalid with subq_impl='reference': "
                         "the captured decode step runs the Triton kernels; allowed: False, or "
                         "subq_impl None/'kernel'")
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


def hf_param_map(config) -> dict:
    """``linear_qs`` <-> ``mixer.qs_proj`` (under ``backbone.layers.i.``) in the hybrid host: the
    name of the Hugging Face remote code megatron_subq ships for NemotronH with Superlinear
    layers (convert/remote/). The GPT families have no Superlinear HF code: none there."""
    return {"linear_qs.weight": "mixer.qs_proj.weight"} if config.is_hybrid else {}


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
    context_parallel="all_to_all",
    decode_cache="kv",
    hf_param_map=hf_param_map,
)
