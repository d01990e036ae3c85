"""PPA — Power-based Partial Attention (../shared/variants.md, "ppa"), ``[B, T, H, D]``.

Offsets ``S_p = {j >= 1 : floor(j^p) - floor((j-1)^p) = 1}`` (p=1/2: 1, 4, 9, 16, ...). Query i
attends key k iff ``k <= i`` and (``i - k <= w`` or ``i - k in S_p``). Offset 0 (self) is always
attended, so p=1 is full causal attention and p=0 a sliding window of w+1 tokens.

Three forms of the same op:

* ``ppa_attention_masked`` — the O(T^2) definition: a [T, T] boolean mask and a plain softmax.
  Only for tests and small T.
* ``ppa_attention_reference`` — the sub-quadratic PyTorch reference. Queries are taken in chunks;
  each chunk meets (1) the dense window band, keys ``[i0 - w, i1)``, and (2) for every power offset
  ``s > w`` the keys ``i - s`` of its queries (one diagonal per offset, gathered). Per chunk that is
  ``C * (C + w + |S_p ∩ (w, T)|)`` scores, i.e. O(T * T^p) over the sequence (O(T * sqrt(T)) at
  p=1/2). With autograd on, every chunk is checkpointed so that training holds no more than one
  chunk's intermediates at a time.
* the Triton kernel (``megatron_subq.kernels.ppa``), chosen by ``impl`` (see ``dispatch``).

Exactness: ``floor(j^p)`` is never taken from a float ``pow``. A power p is the rational a/b of
``powers.as_fraction`` (denominator <= 1000; a float must be exactly the float of that rational,
so 0.5, 1/3, 0.875 and 0.333 (= 333/1000) are accepted and 0.1234 is refused). The power's check
and the offsets live in ``kernels/ppa/plan.py``, shared with the kernel.
"""

from __future__ import annotations

import math
import numbers
from typing import List, Optional

import torch
from torch.utils.checkpoint import checkpoint

from ..kernels.ppa.plan import offsets_array, ppa_power_fraction
from .dispatch import check_cu_seqlens, check_prefill, check_qkv, choose_impl

# Query-key pairs (per batch entry and head) one chunk of the reference may hold.
_CHUNK_PAIRS = 1 << 16


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def _check_window(window, what: str = "window") -> int:
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 0:
        raise ValueError(f"{what}={window!r} is invalid: allowed an integer >= 0")
    return int(window)


# ---------------------------------------------------------------------------------------------
# offsets
# ---------------------------------------------------------------------------------------------
def ppa_offsets(power, max_offset: int) -> List[int]:
    """Sorted ``S_p ∩ [1, max_offset]``: the offsets j >= 1 with floor(j^p) - floor((j-1)^p) = 1.

    Exact for every rational p (``ppa_power_fraction``): p=1/2 -> [1, 4, 9, 16, ...],
    p=1/3 -> [1, 8, 27, ...], p=1 -> [1, 2, ..., max_offset], p=0 -> [].
    """
    p = ppa_power_fraction(power)
    if isinstance(max_offset, bool) or not isinstance(max_offset, numbers.Integral):
        raise ValueError(f"max_offset={max_offset!r} is invalid: allowed an integer >= 0")
    if max_offset < 0:
        raise ValueError(f"max_offset={max_offset!r} is invalid: allowed an integer >= 0")
    return offsets_array(p, int(max_offset)).tolist()


def ppa_far_offsets(power, window: int, seq_len: int, device=None) -> torch.Tensor:
    """The power offsets that lie beyond the window, ``S_p ∩ (w, seq_len)``, as an int64 tensor.

    Offsets <= w are already in the dense band; these are the diagonals a query reaches outside it.
    """
    p = ppa_power_fraction(power)
    w = _check_window(window)
    offsets = offsets_array(p, max(seq_len - 1, 0))
    return torch.from_numpy(offsets[offsets > w].copy()).to(device)


def ppa_mask(seq_len: int, power, window: int, device=None) -> torch.Tensor:
    """The [T, T] boolean PPA mask: ``mask[i, k]`` iff k <= i and (i-k <= w or i-k in S_p)."""
    p = ppa_power_fraction(power)
    w = _check_window(window)
    attended = torch.zeros(max(seq_len, 1), dtype=torch.bool)  # attended[d]: is offset d attended
    attended[: w + 1] = True
    attended[torch.from_numpy(offsets_array(p, max(seq_len - 1, 0)))] = True
    pos = torch.arange(seq_len)
    dist = pos[:, None] - pos[None, :]
    mask = (dist >= 0) & attended[dist.clamp(min=0)]
    return mask.to(device)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32 for half inputs (and fp32), fp64 kept for fp64 (exact comparisons in tests)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# the O(T^2) definition
# ---------------------------------------------------------------------------------------------
def ppa_attention_masked(q, k, v, power, window: int, scale: Optional[float] = None):
    """PPA as a masked [T, T] softmax (fp32 or fp64 inside).

    q: [B, T, H, D]; k, v: [B, T, H_kv, D] -> [B, T, H, D] in q's dtype.
    """
    B, T, H, H_kv, D = check_qkv("ppa_attention", q, k, v)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mask = ppa_mask(T, power, window, device=q.device)
    G = H // H_kv
    dtype = _compute_dtype(q)
    qf = q.to(dtype).view(B, T, H_kv, G, D)
    scores = torch.einsum("bihgd,bjhd->bhgij", qf, k.to(dtype)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhgij,bjhd->bihgd", probs, v.to(dtype))
    return out.reshape(B, T, H, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# the chunked sub-quadratic reference
# ---------------------------------------------------------------------------------------------
def _attend_query_chunk(qc, k, v, far_offsets, i0: int, window: int, scale: float):
    """PPA output of the queries ``qc`` at positions [i0, i1), i1 = i0 + C.

    qc: [B, C, H_kv, G, D] (query head h = kv head h // G, as ``repeat_kv``); k, v: [B, >= i1,
    H_kv, D]; far_offsets: int64 [n], the offsets in S_p with w < s < i1 (sorted). Returns
    [B, C, H_kv, G, D].
    """
    device = qc.device
    i1 = i0 + qc.shape[1]
    pos = torch.arange(i0, i1, device=device)

    # (1) the window band: keys [max(0, i0 - w), i1), dense; keep i-w <= key <= i
    k0 = max(0, i0 - window)
    band_dist = pos[:, None] - torch.arange(k0, i1, device=device)[None, :]  # [C, C + w]
    band_ok = (band_dist >= 0) & (band_dist <= window)
    band_k, band_v = k[:, k0:i1].to(qc.dtype), v[:, k0:i1].to(qc.dtype)
    band_scores = torch.einsum("bchgd,bjhd->bhgcj", qc, band_k) * scale
    band_scores = band_scores.masked_fill(~band_ok, float("-inf"))

    # (2) power offsets beyond the window: key i - s of query i, gathered (one diagonal per s)
    far_keys = pos[:, None] - far_offsets[None, :]  # [C, n]
    far_ok = far_keys >= 0
    far_keys = far_keys.clamp(min=0)
    k_far, v_far = k[:, far_keys].to(qc.dtype), v[:, far_keys].to(qc.dtype)  # [B, C, n, H_kv, D]
    far_scores = torch.einsum("bchgd,bcnhd->bhgcn", qc, k_far) * scale
    far_scores = far_scores.masked_fill(~far_ok, float("-inf"))

    # one softmax over band + diagonals; the two key sets are disjoint (distance <= w vs > w),
    # and the band always holds the query itself, so no row is empty
    probs = torch.cat([band_scores, far_scores], dim=-1).softmax(dim=-1)
    p_band, p_far = probs.split([band_scores.shape[-1], far_scores.shape[-1]], dim=-1)
    return (torch.einsum("bhgcj,bjhd->bchgd", p_band, band_v)
            + torch.einsum("bhgcn,bcnhd->bchgd", p_far, v_far))


def default_chunk_size(seq_len: int, window: int, n_far: int) -> int:
    """Queries per chunk: about ``_CHUNK_PAIRS`` query-key pairs per chunk, at least 16."""
    return max(1, min(seq_len, max(16, _CHUNK_PAIRS // (window + 1 + n_far + 16))))


def ppa_attention_reference(q, k, v, power, window: int, scale: Optional[float] = None,
                            chunk_size: Optional[int] = None):
    """PPA in O(T * (w + T^p)) work and memory per head, chunked over queries (fp32 or fp64 inside).

    q: [B, T, H, D]; k, v: [B, T, H_kv, D] (GQA) -> [B, T, H, D] in q's dtype.
    """
    B, T, H, H_kv, D = check_qkv("ppa_attention", q, k, v)
    w = _check_window(window)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    far = ppa_far_offsets(power, w, T, device=q.device)
    if chunk_size is None:
        chunk_size = default_chunk_size(T, w, far.numel())
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"ppa_attention: chunk_size={chunk_size!r} is invalid: allowed an "
                         "integer >= 1 or None")
    dtype = _compute_dtype(q)
    qf = q.to(dtype).view(B, T, H_kv, H // H_kv, D)
    kf, vf = k.to(dtype), v.to(dtype)
    # Recompute each chunk in backward instead of keeping every chunk's scores and gathered keys.
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for i0 in range(0, T, chunk_size):
        i1 = min(T, i0 + chunk_size)
        far_here = far[: int(torch.searchsorted(far, i1))]  # offsets < i1 reach some key
        args = (qf[:, i0:i1], kf, vf, far_here, i0, w, scale)
        if recompute:
            outs.append(checkpoint(_attend_query_chunk, *args, use_reentrant=False))
        else:
            outs.append(_attend_query_chunk(*args))
    out = torch.cat(outs, dim=1) if outs else qf.new_zeros(B, 0, H_kv, H // H_kv, D)
    return out.reshape(B, T, H, D).to(q.dtype)


@torch.no_grad()
def ppa_prefill(q, k_cache, v_cache, power, window: int, start: Optional[int] = None,
                scale: Optional[float] = None):
    """The queries of positions ``[start, start + C)`` over a key/value cache (decoding; no
    autograd), the chunked reference's gather: each query reads its window band and its power
    offsets only, O(w + L^p) keys.

    q: [B, C, H, D]; k_cache, v_cache: [B, L, H_kv, D] holding positions ``[0, start + C)``
    (entries past ``start + C`` are not read); ``start`` defaults to L - C. Returns [B, C, H, D]
    in q's dtype: rows ``[start, start + C)`` of ``ppa_attention`` over the first start + C
    tokens.
    """
    start = check_prefill("ppa_prefill", q, k_cache, v_cache, start)
    B, C, H, D = q.shape
    w = _check_window(window)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    end = start + C
    far = ppa_far_offsets(power, w, end, device=q.device)
    dtype = _compute_dtype(q)
    H_kv = k_cache.shape[2]
    qf = q.to(dtype).reshape(B, C, H_kv, H // H_kv, D)
    chunk = default_chunk_size(C, w, far.numel())  # keys gathered per chunk, cast there
    outs = [_attend_query_chunk(qf[:, a:a + chunk], k_cache, v_cache, far, start + a, w, scale)
            for a in range(0, C, chunk)]
    return torch.cat(outs, dim=1).reshape(B, C, H, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def _kernel():
    try:
        from megatron_subq.kernels.ppa import ppa_attention_kernel  # noqa: PLC0415
    except ImportError:
        return None
    return ppa_attention_kernel


def _per_sequence(fn, q, k, v, bounds: list, *args, **kwargs):
    """Apply ``fn`` to every packed sequence ``[bounds[i], bounds[i+1])`` separately (B = 1)."""
    outs = [fn(q[:, a:b], k[:, a:b], v[:, a:b], *args, **kwargs)
            for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat(outs, dim=1) if outs else torch.empty_like(q)


def ppa_attention(q, k, v, power, window: int, impl: Optional[str] = None,
                  scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None):
    """Power-based partial attention. q: [B, T, H, D]; k, v: [B, T, H_kv, D] -> [B, T, H, D].

    ``power`` p in [0, 1] (a rational, see ``ppa_power_fraction``), ``window`` w >= 0; scale
    1/sqrt(D) unless given. ``impl``: "reference" (``ppa_attention_reference``), "kernel"
    (Triton) or None (the kernel on CUDA, else the reference). ``cu_seqlens`` (optional, B = 1):
    variable-length sequences packed along T, ``[0, end_1, ..., T]``; positions and offsets count
    within each sequence and no query sees another sequence's keys.
    """
    check_qkv("ppa_attention", q, k, v)
    p = ppa_power_fraction(power)  # checked once here; the kernel takes the Fraction as is
    w = _check_window(window)
    bounds = None if cu_seqlens is None else check_cu_seqlens("ppa_attention", cu_seqlens, q)
    kernel = _kernel()
    if choose_impl("ppa_attention", impl, (q, k, v), kernel) == "kernel":
        return kernel(q, k, v, p, w, scale=scale, cu_seqlens=cu_seqlens)
    if bounds is not None:
        return _per_sequence(ppa_attention_reference, q, k, v, bounds, p, w, scale=scale)
    return ppa_attention_reference(q, k, v, p, w, scale=scale)


__all__ = ["ppa_attention", "ppa_attention_reference", "ppa_prefill", "ppa_attention_masked",
           "ppa_offsets",
           "ppa_far_offsets", "ppa_mask", "ppa_power_fraction", "default_chunk_size"]
