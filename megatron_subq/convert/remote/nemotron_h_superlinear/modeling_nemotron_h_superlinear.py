"""NemotronH with Superlinear attention layers: the model (Hugging Face remote code).

Shipped by megatron_subq and copied into the folders ``export_hf`` writes; loaded with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``. Everything but the
Superlinear attention layers is transformers' own NemotronH (>= 5.3): the Mamba-2, MLP and MoE
layers, the standard attention layers, the hub weight layout (``backbone.*``, one tensor per
expert: transformers' NemotronH conversion mapping is registered for this class too).

A Superlinear layer (``config.superlinear_layers``) is NemotronH's attention (q/k/v/o, GQA, no
position embedding) plus the search-query projection ``qs_proj`` (hidden -> heads * head_dim;
megatron_subq's ``self_attention.linear_qs``), and computes Superlinear multi-step attention
(N=2), exactly megatron_subq's definition (``megatron_subq/ops/superlinear``) with the same exact
integer geometry. For query position i, p = search power, w = floor((sw_index+1)^(1/p)) - 1:

* candidate anchors t = i - d_s, d_s = floor((s+1)^(1/p)) - 1 for s >= sw_index, d_s <= i (the
  anchors s < sw_index are exactly those inside the window W = [max(0, i-w+1), i]);
* search scores Q_s(i) . K(t) (unscaled); the top-k by score (ties: the nearer anchor); the gate
  alpha = softmax over the kept scores;
* span of anchor t: [max(0, t - ceil(b l)), min(i, t + ceil(f l))], l = ceil(i^p_sp);
* A_t = softmax attention of Q(i) (scale 1/sqrt(D)) over span u W (de-duplicated);
  o_i = sum_t alpha_t A_t; a query without anchors attends over W alone.

Powers are exact (p and p_sp taken as the rationals they stand for, denominators <= 1000, as
megatron_subq's ``as_fraction``), so anchors, spans and windows are the project's to the key.

Implementation: this file's PyTorch (``superlinear_rows``: float32 compute, chunks of queries,
spans gathered, O(sqrt(L)) keys per query at p = 1/2), or, with ``superlinear_impl="auto"`` on
CUDA where megatron_subq is importable, its op and kernels. Cache: the KV cache is the whole
state (the search key is the ordinary key), so ``generate`` with transformers' cache is exact:
each chunk of queries [start, start + C) reads the cached keys [0, start + C). Padding is not
supported (a 2-D ``attention_mask`` with zeros raises): Superlinear's geometry counts positions
from the first token.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache
from typing import Optional, Tuple

import torch
from torch import nn
from transformers import NemotronHForCausalLM
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHAttention

from .configuration_nemotron_h_superlinear import NemotronHSuperlinearConfig

QUERY_CHUNK = 64


# ---------------------------------------------------------------------------------------------
# exact integer geometry (positions and knobs only)
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _rational(p) -> Fraction:
    """The rational a float power stands for (denominator <= 1000: 1/3 is exactly 1/3)."""
    return Fraction(p).limit_denominator(1000)


def _root(n: int, b: int) -> int:
    """floor(n^(1/b)) for integers n >= 0, b >= 1."""
    if n < 2 or b == 1:
        return n
    r = int(round(float(n) ** (1.0 / b))) if n < 2 ** 52 else 1 << -(-n.bit_length() // b)
    while r ** b > n:
        r -= 1
    while (r + 1) ** b <= n:
        r += 1
    return r


@lru_cache(maxsize=1 << 16)
def _floor_pow(x: int, p) -> int:
    """floor(x^p) exactly (0^0 = 1)."""
    f = _rational(p)
    return 1 if f == 0 else _root(x ** f.numerator, f.denominator)


def _ceil_pow(x: int, p) -> int:
    """ceil(x^p) exactly (0^0 = 1)."""
    f = _rational(p)
    r = _floor_pow(x, f)
    return r if f == 0 or r ** f.denominator == x ** f.numerator else r + 1


def superlinear_window(search_power, sw_index: int) -> int:
    """w = floor((sw_index+1)^(1/p)) - 1 (0: no window)."""
    return _floor_pow(sw_index + 1, 1 / _rational(search_power)) - 1


@lru_cache(maxsize=64)
def anchor_offsets(stop: int, search_power, sw_index: int) -> Tuple[int, ...]:
    """d_s = floor((s+1)^(1/p)) - 1 for s >= sw_index while d_s < stop: query i's candidate
    anchors are i - d_s for d_s <= i."""
    inv, out, s = 1 / _rational(search_power), [], sw_index
    while (d := _floor_pow(s + 1, inv) - 1) < stop:
        out.append(d)
        s += 1
    return tuple(out)


@lru_cache(maxsize=64)
def span_extents(start: int, stop: int, span_power, backward_factor,
                 forward_factor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(ceil(b l(i)), ceil(f l(i))) for i in [start, stop), l(i) = ceil(i^p_sp), exactly."""
    b, f = _rational(backward_factor), _rational(forward_factor)
    ell = [_ceil_pow(i, span_power) for i in range(start, stop)]
    return tuple(math.ceil(b * x) for x in ell), tuple(math.ceil(f * x) for x in ell)


# ---------------------------------------------------------------------------------------------
# the attention, in PyTorch
# ---------------------------------------------------------------------------------------------
def _rows_chunk(q, q_s, k, v, i0: int, offsets, back, fwd, window: int, topk: int):
    """Rows [i0, i0 + c) (float32 tensors). q, q_s: [B, c, H, D]; k, v: [B, >= i0 + c, Hk, D];
    offsets [A], back/fwd [c] (long, on q's device). Returns [B, c, H, D]."""
    B, c, H, D = q.shape
    Hk = k.shape[2]
    rep = H // Hk
    dev = q.device
    low = torch.finfo(q.dtype).min
    scale = 1.0 / math.sqrt(D)
    i = torch.arange(i0, i0 + c, device=dev)  # query positions [c]
    heads = torch.arange(H, device=dev)
    bsel = torch.arange(B, device=dev)

    # the window W = [win_lo, i] (empty when w = 0): one slab of keys for the whole chunk
    win_lo = (i - window + 1).clamp(min=0) if window > 0 else i + 1
    s0 = max(0, i0 - window + 1) if window > 0 else i0 + c
    slab = torch.arange(s0, i0 + c, device=dev)  # [S]
    k_w = k[:, s0:i0 + c].repeat_interleave(rep, dim=2)  # [B, S, H, D]
    v_w = v[:, s0:i0 + c].repeat_interleave(rep, dim=2)
    in_w = (slab[None] >= win_lo[:, None]) & (slab[None] <= i[:, None])  # [c, S]
    logit_w = torch.einsum("bchd,bshd->bchs", q, k_w) * scale
    logit_w = logit_w.masked_fill(~in_w[None, :, None, :], low)
    only_window = torch.einsum("bchs,bshd->bchd", logit_w.softmax(-1), v_w)
    if offsets.numel() == 0:  # every candidate lies in the window
        return only_window

    # the search: scores at the candidate anchors i - d (nearest first), top-k, the gate
    t = i[:, None] - offsets[None, :]  # [c, A]
    cand = t >= 0
    k_t = k[:, t.clamp(min=0)]  # [B, c, A, Hk, D]
    k_t = k_t.repeat_interleave(rep, dim=3)  # [B, c, A, H, D]
    score = torch.einsum("bchd,bcahd->bcha", q_s, k_t)
    score = score.masked_fill(~cand[None, :, None, :], low)
    n = min(topk, offsets.numel())
    # ties: the nearer anchor (lower column); a stable sort keeps column order among equals
    col = torch.sort(score.detach(), dim=-1, descending=True, stable=True).indices[..., :n]
    kept = cand[None, :, None, :].expand_as(score).gather(-1, col)  # [B, c, H, n]
    gate = score.gather(-1, col).softmax(-1) * kept
    anchor = i[None, :, None, None] - offsets[col]  # [B, c, H, n]

    # each kept anchor's span, minus the keys of the window (the union is de-duplicated)
    lo = (anchor - back[None, :, None, None]).clamp(min=0)
    hi = torch.minimum(anchor + fwd[None, :, None, None], i[None, :, None, None])
    hi = torch.minimum(hi, win_lo[None, :, None, None] - 1)
    J = int((back + fwd).max()) + 1
    key = lo[..., None] + torch.arange(J, device=dev)  # [B, c, H, n, J]
    in_span = (key <= hi[..., None]) & kept[..., None]
    key = torch.minimum(key, i[None, :, None, None, None])  # never past the query
    kv_head = (heads // rep)[None, None, :, None, None]
    k_s = k[bsel[:, None, None, None, None], key, kv_head]  # [B, c, H, n, J, D]
    v_s = v[bsel[:, None, None, None, None], key, kv_head]
    logit_s = torch.einsum("bchd,bchnjd->bchnj", q, k_s) * scale
    logit_s = logit_s.masked_fill(~in_span, low)

    # A_t: one softmax over span(t) u W per kept anchor, then the gated sum
    both = torch.cat([logit_s, logit_w[:, :, :, None, :].expand(-1, -1, -1, n, -1)], dim=-1)
    prob = both.softmax(-1)
    per_anchor = (torch.einsum("bchnj,bchnjd->bchnd", prob[..., :J], v_s)
                  + torch.einsum("bchns,bshd->bchnd", prob[..., J:], v_w))
    mixed = torch.einsum("bchn,bchnd->bchd", gate, per_anchor)
    return torch.where(kept.any(-1, keepdim=True), mixed, only_window)


def superlinear_rows(q, q_s, k, v, start: int = 0, *, search_power=0.5, span_power=0.5, topk=2,
                     backward_factor=2.0, forward_factor=0.0, sw_index=0,
                     query_chunk: int = QUERY_CHUNK):
    """Superlinear attention of the queries of positions [start, start + C) over the keys
    [0, start + C) (the full forward: start = 0 and C = T).

    q, q_s: [B, C, H, D]; k, v: [B, L, H_kv, D] with L >= start + C (rows past start + C are not
    read); H % H_kv == 0. Computes in float32 (float64 stays float64); returns q's dtype."""
    B, C, H, D = q.shape
    stop = start + C
    if k.shape[1] < stop or q_s.shape != q.shape or H % k.shape[2]:
        raise ValueError(f"superlinear_rows: q {tuple(q.shape)}, q_s {tuple(q_s.shape)}, k "
                         f"{tuple(k.shape)} at start={start}: need q_s like q, H % H_kv == 0 "
                         "and k holding the keys [0, start + C)")
    dtype = torch.promote_types(q.dtype, torch.float32)
    qc, qsc = q.to(dtype), q_s.to(dtype)
    kc, vc = k[:, :stop].to(dtype), v[:, :stop].to(dtype)
    offsets = torch.tensor(anchor_offsets(stop, search_power, sw_index), dtype=torch.long,
                           device=q.device)
    back, fwd = (torch.tensor(x, dtype=torch.long, device=q.device) for x in span_extents(
        start, stop, span_power, backward_factor, forward_factor))
    window = superlinear_window(search_power, sw_index)
    outs = []
    for r0 in range(0, C, query_chunk):
        r1 = min(C, r0 + query_chunk)
        outs.append(_rows_chunk(qc[:, r0:r1], qsc[:, r0:r1], kc, vc, start + r0, offsets,
                                back[r0:r1], fwd[r0:r1], window, topk))
    return torch.cat(outs, dim=1).to(q.dtype)


def _knobs(config) -> dict:
    return dict(search_power=config.superlinear_search_power,
                span_power=config.superlinear_span_power, topk=config.superlinear_topk,
                backward_factor=config.superlinear_backward_factor,
                forward_factor=config.superlinear_forward_factor,
                sw_index=config.superlinear_sw_index)


def _project_op():
    """megatron_subq's op (its kernels where they run), or None where it is not installed."""
    try:
        from megatron_subq.ops.superlinear import (  # noqa: PLC0415
            superlinear_attention,
            superlinear_prefill,
        )
    except ImportError:
        return None
    return superlinear_attention, superlinear_prefill


def superlinear_layer_indices(config) -> list:
    """The 0-based indices of the Superlinear layers: ``superlinear_layers``, or every attention
    layer (refused: an index that is not an attention layer)."""
    attention = [i for i, t in enumerate(config.layers_block_type)
                 if t in ("full_attention", "attention")]
    chosen = attention if config.superlinear_layers is None else list(config.superlinear_layers)
    bad = [i for i in chosen if i not in attention]
    if bad:
        raise ValueError(f"superlinear_layers={config.superlinear_layers!r}: layer(s) {bad} are "
                         f"not attention layers; allowed: a subset of {attention}")
    return chosen


class NemotronHSuperlinearAttention(NemotronHAttention):
    """NemotronH's attention (q/k/v/o projections, GQA, no positions) plus ``qs_proj``, the
    search-query projection, computing Superlinear attention (module docstring)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.qs_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim,
                                 bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, cache=None,
                past_key_values=None, **kwargs):
        """[B, T, hidden] -> ([B, T, hidden], None); with a cache, T new tokens after the cached
        ones (their keys are appended first)."""
        cache = cache if cache is not None else past_key_values
        B, T, _ = hidden_states.shape
        shape = (B, T, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        q_s = self.qs_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape)
        start = 0
        if cache is not None:
            start = int(cache.get_seq_length(self.layer_idx))
            try:
                k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2),
                                            self.layer_idx, kwargs=kwargs)
            except TypeError:  # older caches: update(k, v, layer_idx, cache_kwargs)
                k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2),
                                            self.layer_idx, {})
            # a static cache hands back its whole buffer: keys [0, start + T) only
            k = k_all.transpose(1, 2)[:, :start + T]
            v = v_all.transpose(1, 2)[:, :start + T]
        out = self._attend(q, q_s, k, v, start)
        return self.o_proj(out.reshape(B, T, -1)), None

    def _attend(self, q, q_s, k, v, start: int):
        knobs = _knobs(self.config)
        if getattr(self.config, "superlinear_impl", "auto") == "auto" and q.is_cuda:
            op = _project_op()
            if op is not None:
                if start == 0 and k.shape[1] == q.shape[1]:
                    return op[0](q, q_s, k.contiguous(), v.contiguous(), **knobs)
                return op[1](q, q_s, k.contiguous(), v.contiguous(), start=start, **knobs)
        return superlinear_rows(q, q_s, k, v, start, **knobs)


class NemotronHSuperlinearForCausalLM(NemotronHForCausalLM):
    """transformers' ``NemotronHForCausalLM`` with Superlinear attention in the layers of
    ``config.superlinear_layers`` (module docstring)."""

    config_class = NemotronHSuperlinearConfig
    config: NemotronHSuperlinearConfig

    def __init__(self, config: NemotronHSuperlinearConfig):
        super().__init__(config)
        for i in superlinear_layer_indices(config):
            self.model.layers[i].mixer = NemotronHSuperlinearAttention(config, layer_idx=i)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
        """NemotronH's forward; a 2-D ``attention_mask`` must be all ones (no padding)."""
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
                and not bool(attention_mask.bool().all()):
            raise ValueError("NemotronHSuperlinearForCausalLM: padded batches (attention_mask "
                             "with zeros) are not supported; allowed: unpadded sequences (one "
                             "prompt per call, or prompts of equal length)")
        return super().forward(input_ids, attention_mask, *args, **kwargs)


def _register_weight_layout() -> None:
    """Load and save the hub layout (``backbone.*``, one tensor per expert) as transformers'
    NemotronH does: its conversion mapping, registered for this class (custom code gets none
    otherwise). Versions without the mapping need none."""
    try:
        from transformers.conversion_mapping import (  # noqa: PLC0415
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    mapping = get_checkpoint_conversion_mapping("nemotron_h")
    if mapping is not None:
        register_checkpoint_conversion_mapping(NemotronHSuperlinearForCausalLM.__name__, mapping,
                                               overwrite=True)


_register_weight_layout()

__all__ = ["NemotronHSuperlinearAttention", "NemotronHSuperlinearForCausalLM",
           "superlinear_rows", "anchor_offsets", "span_extents", "superlinear_window"]
