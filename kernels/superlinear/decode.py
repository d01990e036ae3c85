"""Superlinear decode: one query per (batch, head) at position i over a KV cache, O(sqrt(i)) work.

At p = p_sp = 1/2 a decode step touches, per query head, ~sqrt(i) anchor keys (search), top-k
spans of <= ceil(b*l) + ceil(f*l) + 1 keys with l = ceil(sqrt(i)), and the w window keys: no
part of the step reads O(i) memory or launches O(i) work. Three launches (the paper's decode path
is built from standard ops; here each stage is one small kernel, so a step costs three launches
and its reads of the cache):

1. ``decode_search_kernel`` (grid: anchor blocks x B*H_kv): the search scores q_s . k(i - d_a) of
   all GROUP query heads of a key head, each anchor key loaded once for the group. Writes
   ``scores [B*H, A]`` (A = the number of candidates, ~i^p).
2. ``decode_attend_kernel`` (grid: parts x B*H): split-K attention. Part j < N_WIN covers a
   CHUNK of the window [i - w + 1, i]; part N_WIN + slot * N_SPAN + c covers the c-th CHUNK of the
   span (outside the window) of the slot-th best anchor. A span part first finds its anchor: the
   slot-th best of the head's scores (k rounds of arg-max, ties to the lower index = the nearer
   anchor, the reference's rule), then runs an online softmax over its keys. Writes the part's
   running max m, sum l and unnormalised output (float32); the first part of a slot also writes
   the slot's kept score (-inf: no such candidate).
3. ``decode_combine_kernel`` (grid: B*H): per slot, the window parts and the slot's span parts
   merged by log-sum-exp (BLOCK_P parts at a time) into A_slot (attention over span u window),
   the gate softmax over the kept scores, o = sum_slot gate * A_slot; no anchor at all: the
   window attention.

On a GPU the dots run on the tensor cores (``mma``, the default up to head dim 128; the
interpreter keeps CUDA-core dots): the search scores a block of anchors against all the group's
query heads in one ``tl.dot``, and the attend kernel puts q in row 0 of a 16-row tile (tl.dot's
smallest) and the probabilities in rows 0 and 1 as a hi + lo pair of v's dtype, so K and V stay
in 16 bits and P·V keeps ~16 significant bits (``decode_tiles``; 1M: 0.135 -> 0.096 ms a step on
an H100, docs/benchmarks.md).

Everything position-dependent (offsets table, #candidates, window, span extents) is integer
arithmetic on the host (``ops.superlinear``); the offset table lives on the device once per
capacity bucket (next power of two of the length). Two host forms:

* ``superlinear_decode_kernel`` (eager, what the op calls): the step's integers are launch
  arguments and the grids fit the step; no host-to-device copy.
* ``SuperlinearDecodePlan`` (CUDA-graph capturable): the integers sit in a device buffer the
  kernels read (``GEO_BUF``), written by ``set_length`` with one small copy before each replay;
  grids, part layout and work buffers are fixed for a whole capacity bucket, so one captured
  graph serves every length of the bucket. A captured step costs its kernels' time and one
  graph launch instead of three launches, the allocations and their host work.
"""

from __future__ import annotations

import bisect
import math
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..checks import triton_interpreting
from ..launch import cdiv, pow2
from .launch import precision
from .plan import (anchor_offsets, capacity_bucket, ceil_power, ceil_times, superlinear_window,
                   to_device)


@triton.jit
def decode_search_kernel(QS, K, OFF, SCORES, GEO, POS, A, A_STRIDE, H, GROUP, D,
                         s_qb, s_qh, s_kb, s_kt, s_kh,
                         BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr, GEO_BUF: tl.constexpr,
                         MMA: tl.constexpr, BLOCK_G: tl.constexpr, PREC: tl.constexpr):
    if GEO_BUF:  # the step's integers from the device (a captured graph's launches are fixed)
        POS = tl.load(GEO + 0)
        A = tl.load(GEO + 1)
    pid_a = tl.program_id(0)
    pid_bk = tl.program_id(1)
    h_kv = H // GROUP
    b = pid_bk // h_kv
    hk = pid_bk % h_kv
    offs_a = pid_a * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_d = tl.arange(0, BLOCK_D)
    a_mask = offs_a < A
    d_mask = offs_d < D
    t = POS - tl.load(OFF + offs_a, mask=a_mask, other=0)  # candidates a < A have t >= 0
    t = t.to(tl.int64)  # t * s_kt passes 2^31 from ~8M tokens of context (GQA 2 x 128)
    k = tl.load(K + b.to(tl.int64) * s_kb + t[:, None] * s_kt + hk * s_kh + offs_d[None, :],
                mask=a_mask[:, None] & d_mask[None, :], other=0.0)
    if MMA:  # the group's query heads as the columns of one tensor-core product
        offs_g = tl.arange(0, BLOCK_G)
        g_mask = offs_g < GROUP
        h = hk * GROUP + offs_g
        qs = tl.load(QS + b * s_qb + h[:, None] * s_qh + offs_d[None, :],
                     mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(k, tl.trans(qs.to(k.dtype)), input_precision=PREC)  # [BLOCK_A, BLOCK_G]
        tl.store(SCORES + (b * H + h)[None, :] * A_STRIDE + offs_a[:, None], s,
                 mask=a_mask[:, None] & g_mask[None, :])
    else:
        k = k.to(tl.float32)
        for g in range(0, GROUP):  # the group's query heads share the anchor keys
            h = hk * GROUP + g
            qs = tl.load(QS + b * s_qb + h * s_qh + offs_d, mask=d_mask, other=0.0).to(
                tl.float32)
            s = tl.sum(k * qs[None, :], axis=1)
            tl.store(SCORES + (b * H + h) * A_STRIDE + offs_a, s, mask=a_mask)


@triton.jit
def decode_attend_kernel(Q, K, V, SCORES, OFF, PART_M, PART_L, PART_O, SEL_S, GEO,
                         POS, A, A_STRIDE, H, GROUP, D, WIN_LO, BACK, FWD, N_WIN, N_SPAN, NPART,
                         scale, s_qb, s_qh, s_kb, s_kt, s_kh,
                         TOPK: tl.constexpr, BLOCK_ALL: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GEO_BUF: tl.constexpr,
                         MMA: tl.constexpr, PREC: tl.constexpr):
    if GEO_BUF:  # N_WIN, N_SPAN, NPART are then the bucket's largest: extra parts are empty
        POS = tl.load(GEO + 0)
        A = tl.load(GEO + 1)
        WIN_LO = tl.load(GEO + 2)
        BACK = tl.load(GEO + 3)
        FWD = tl.load(GEO + 4)
    j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D

    if j < N_WIN:  # a chunk of the window [WIN_LO, POS]
        r_lo = WIN_LO + j * CHUNK
        r_hi = tl.minimum(POS, r_lo + CHUNK - 1)
    else:  # a chunk of the span of the slot-th best anchor
        slot = (j - N_WIN) // N_SPAN
        c = (j - N_WIN) % N_SPAN
        idx = tl.arange(0, BLOCK_ALL)
        scores = tl.load(SCORES + pid_bh * A_STRIDE + idx, mask=idx < A, other=float("-inf"))
        best = float("-inf")
        best_a = 0
        for r in tl.static_range(TOPK):  # r-th best: arg-max, ties to the lower index (nearer)
            m = tl.max(scores, axis=0)
            a_r = tl.min(tl.where(scores == m, idx, BLOCK_ALL), axis=0)
            best = tl.where(r == slot, m, best)
            best_a = tl.where(r == slot, a_r, best_a)
            scores = tl.where(idx == a_r, float("-inf"), scores)
        valid = best > float("-inf")
        t = POS - tl.load(OFF + tl.minimum(best_a, A_STRIDE - 1))
        lo = tl.maximum(t - BACK, 0)
        hi = tl.minimum(tl.minimum(t + FWD, POS), WIN_LO - 1)  # keys outside the window only
        r_lo = lo + c * CHUNK
        r_hi = tl.where(valid, tl.minimum(hi, r_lo + CHUNK - 1), r_lo - 1)
        if c == 0:
            tl.store(SEL_S + pid_bh * TOPK + slot, best)

    q = tl.load(Q + b * s_qb + h * s_qh + offs_d, mask=d_mask, other=0.0)
    if MMA:  # q as row 0 of a 16-row tile (tl.dot's smallest): the tensor cores take the dots
        rows = tl.arange(0, 16)
        q_rows = tl.where(rows[:, None] == 0, q[None, :], 0.0).to(Q.dtype.element_ty)
    else:
        q = q.to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(r_lo, r_hi + 1, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols <= r_hi
        kv_mask = n_mask[:, None] & d_mask[None, :]
        ptr = b.to(tl.int64) * s_kb + cols.to(tl.int64)[:, None] * s_kt + hk * s_kh + \
            offs_d[None, :]
        k = tl.load(K + ptr, mask=kv_mask, other=0.0)
        v = tl.load(V + ptr, mask=kv_mask, other=0.0)
        if MMA:  # the zero rows add exact zeros: the column sum is row 0's dot
            dots = tl.sum(tl.dot(q_rows, tl.trans(k), input_precision=PREC), axis=0)
        else:
            dots = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        s = tl.where(n_mask, dots * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every tile has a key
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if MMA:  # p in two rows of v's dtype, hi + lo: ~16 significant bits, not bf16's 8
            p_hi = p.to(V.dtype.element_ty)
            p_lo = (p - p_hi.to(tl.float32)).to(V.dtype.element_ty)
            p_rows = tl.where(rows[:, None] == 0, p_hi[None, :],
                              tl.where(rows[:, None] == 1, p_lo[None, :], 0.0))
            pv = tl.sum(tl.dot(p_rows.to(V.dtype.element_ty), v, input_precision=PREC), axis=0)
        else:
            pv = tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        acc = acc * alpha + pv
        m_i = m_new
    out = pid_bh * NPART + j
    tl.store(PART_M + out, m_i)
    tl.store(PART_L + out, l_i)
    tl.store(PART_O + out * D + offs_d, acc, mask=d_mask)


@triton.jit
def _merge_parts(PART_M, PART_L, PART_O, row0, first, stop, D,
                 BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """Log-sum-exp merge of the parts [first, stop) of one head (rows row0 + j), BLOCK_P at a
    time: (max, sum, unnormalised output); (-inf, 0, 0) for none."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m = float("-inf")
    total = 0.0
    o = tl.zeros([BLOCK_D], tl.float32)
    for j0 in range(first, stop, BLOCK_P):
        parts = j0 + offs_p
        p_mask = parts < stop
        row = row0 + parts
        part_m = tl.load(PART_M + row, mask=p_mask, other=float("-inf"))
        part_l = tl.load(PART_L + row, mask=p_mask, other=0.0)
        part_o = tl.load(PART_O + row[:, None] * D + offs_d[None, :],
                         mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(part_m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(part_m > float("-inf"), tl.exp(part_m - m_safe), 0.0)
        c = tl.where(m > float("-inf"), tl.exp(m - m_safe), 0.0)
        total = total * c + tl.sum(w * part_l, axis=0)
        o = o * c + tl.sum(w[:, None] * part_o, axis=0)
        m = m_new
    return m, total, o


@triton.jit
def decode_combine_kernel(PART_M, PART_L, PART_O, SEL_S, O, H, D, N_WIN, N_SPAN, NPART,
                          s_ob, s_oh,
                          TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    row0 = pid_bh * NPART
    m_w, l_w, o_w = _merge_parts(PART_M, PART_L, PART_O, row0, 0, N_WIN, D, BLOCK_P, BLOCK_D)

    # the gate: softmax over the kept slots' scores
    slots = tl.arange(0, TOPK_PAD)
    sel_s = tl.load(SEL_S + pid_bh * TOPK + slots, mask=slots < TOPK, other=float("-inf"))
    kept = sel_s > float("-inf")
    top = tl.max(sel_s, axis=0)
    e = tl.where(kept, tl.exp(sel_s - tl.where(top == float("-inf"), 0.0, top)), 0.0)
    gate = e / tl.maximum(tl.sum(e, axis=0), 1e-30)

    mixed = tl.zeros([BLOCK_D], tl.float32)
    for slot in tl.static_range(TOPK):
        first = N_WIN + slot * N_SPAN
        m_s, l_s, o_s = _merge_parts(PART_M, PART_L, PART_O, row0, first, first + N_SPAN, D,
                                     BLOCK_P, BLOCK_D)
        m = tl.maximum(m_s, m_w)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        c_s = tl.where(m_s > float("-inf"), tl.exp(m_s - m_safe), 0.0)
        c_w = tl.where(m_w > float("-inf"), tl.exp(m_w - m_safe), 0.0)
        den = c_s * l_s + c_w * l_w
        a_slot = (c_s * o_s + c_w * o_w) / tl.where(den > 0, den, 1.0)  # A_{i,t}
        mixed += tl.sum(tl.where(slots == slot, gate, 0.0), axis=0) * a_slot
    window_only = o_w / tl.where(l_w > 0, l_w, 1.0)
    out = tl.where(tl.max(kept.to(tl.int32), axis=0) > 0, mixed, window_only)
    tl.store(O + b * s_ob + h * s_oh + offs_d, out.to(O.dtype.element_ty), mask=d_mask)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
_OFFSETS: Dict[tuple, Tuple[Tuple[int, ...], torch.Tensor]] = {}


def decode_offsets(capacity: int, search_power, sw_index: int, device):
    """The offset table of a capacity bucket: (the tuple, an int32 device copy), cached."""
    key = (capacity, search_power, sw_index, str(device))
    if key not in _OFFSETS:
        offsets = anchor_offsets(capacity, search_power, sw_index)
        table = to_device(torch.tensor(offsets or (capacity,), dtype=torch.int32), device)
        _OFFSETS[key] = (offsets, table)
    return _OFFSETS[key]


def decode_geometry(length: int, search_power=0.5, span_power=0.5, backward_factor=2.0,
                    forward_factor=0.0, sw_index=0) -> dict:
    """Everything position-dependent of the query at i = length - 1, in exact integer arithmetic:
    #candidates, window start, span extents (the reference's definitions)."""
    pos = length - 1
    offsets = anchor_offsets(capacity_bucket(length), search_power, sw_index)
    w = superlinear_window(search_power, sw_index)
    scale = ceil_power(pos, span_power)
    return dict(pos=pos, candidates=bisect.bisect_right(offsets, pos),
                a_stride=max(1, len(offsets)), win_lo=max(0, pos - w + 1) if w > 0 else pos + 1,
                back=ceil_times(backward_factor, scale), fwd=ceil_times(forward_factor, scale))


def decode_chunk_default() -> int:
    return 16 if triton_interpreting() else 256  # keys per split-K part (docs/benchmarks.md)


# the attend kernel's defaults on a GPU: keys per tile, warps, tensor-core dots (docs/benchmarks.md,
# "Superlinear decode: the step on the tensor cores"); the interpreter's: 16-key tiles, CUDA cores
DECODE_TILE_DEFAULTS = dict(block_n=64, warps=4, mma=True)


def decode_tiles(chunk: int, head_dim: int, block_n: Optional[int] = None,
                 warps: Optional[int] = None, mma: Optional[bool] = None) -> Tuple[int, int, bool]:
    """(keys per tile, warps, tensor-core dots) of the attend kernel, None for the defaults.
    ``mma``: q (and the probabilities, as a bf16/fp16 hi + lo pair) as rows of a 16-row tile,
    the dots on the tensor cores; needs tiles of >= 16 keys. By default on a GPU up to head dim
    128, the width its GPU tests and timings cover (wider heads keep the CUDA-core form unless
    asked)."""
    interp = triton_interpreting()
    block_n = block_n or min(chunk, 16 if interp else DECODE_TILE_DEFAULTS["block_n"])
    warps = warps or DECODE_TILE_DEFAULTS["warps"]
    if mma is None:
        mma = DECODE_TILE_DEFAULTS["mma"] and not interp and block_n >= 16 and head_dim <= 128
    for name, value in (("block_n", block_n), ("warps", warps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 \
                or value & (value - 1):
            raise ValueError(f"superlinear decode: {name}={value!r} is invalid: allowed a power "
                             "of two >= 1")
    if mma and block_n < 16:
        raise ValueError(f"superlinear decode: mma=True needs block_n >= 16 (tl.dot's smallest "
                         f"tile), got block_n={block_n}")
    return block_n, warps, bool(mma)


def _layout(geo: dict, chunk: int, topk: int) -> Tuple[int, int, int]:
    """(window parts, parts per span, all parts) of a step's split-K layout."""
    n_win = cdiv(geo["pos"] - geo["win_lo"] + 1, chunk)
    n_span = max(1, cdiv(geo["back"] + geo["fwd"] + 1, chunk))
    return n_win, n_span, n_win + topk * n_span


def _launch(q, q_s, k, v, out, geo, offsets, a_stride, n_win, n_span, topk, chunk, tiles,
            scores, part_m, part_l, part_o, sel_s, geo_buf):
    """The three launches of one step. ``geo_buf`` None: the step's integers (``geo``) are kernel
    arguments and the grids fit them; a device int32 tensor [5] (pos, candidates, window start,
    back, forward): the kernels read them there, and grids and part layout are ``a_stride`` /
    ``n_win`` / ``n_span`` as given (a bucket's largest), so the launches are the same at every
    length of the bucket and a CUDA graph can replay them."""
    B, H, D = q.shape
    H_kv = k.shape[2]
    block_n, warps, mma = tiles
    block_d = max(16, pow2(D))
    prec = precision(q.dtype)  # fp32: exact products, no TF32
    n_part = n_win + topk * n_span
    from_buf = geo_buf is not None
    geo_t = geo_buf if from_buf else offsets  # any pointer: not read without GEO_BUF
    n_cand = a_stride if from_buf else geo["candidates"]  # search blocks: all of the bucket
    # from the buffer: constant (unread) arguments, so Triton's value specialisations never
    # change between lengths and the launches stay the same kernels
    ints = dict(POS=0, A=0, WIN_LO=0, BACK=0, FWD=0) if from_buf else dict(
        POS=geo["pos"], A=geo["candidates"], WIN_LO=geo["win_lo"], BACK=geo["back"],
        FWD=geo["fwd"])
    if n_cand > 0:
        block_a = 64 if not triton_interpreting() else 16
        decode_search_kernel[(cdiv(n_cand, block_a), B * H_kv)](
            QS=q_s, K=k, OFF=offsets, SCORES=scores, GEO=geo_t, POS=ints["POS"], A=ints["A"],
            A_STRIDE=a_stride, H=H, GROUP=H // H_kv, D=D, s_qb=q_s.stride(0),
            s_qh=q_s.stride(1), s_kb=k.stride(0), s_kt=k.stride(1), s_kh=k.stride(2),
            BLOCK_A=block_a, BLOCK_D=block_d, GEO_BUF=from_buf, MMA=mma,
            BLOCK_G=max(16, pow2(H // H_kv)), PREC=prec, num_warps=4)
    decode_attend_kernel[(n_part, B * H)](
        Q=q, K=k, V=v, SCORES=scores, OFF=offsets, PART_M=part_m, PART_L=part_l, PART_O=part_o,
        SEL_S=sel_s, GEO=geo_t, **ints, A_STRIDE=a_stride, H=H, GROUP=H // H_kv, D=D,
        N_WIN=n_win, N_SPAN=n_span, NPART=n_part, scale=1.0 / math.sqrt(D), s_qb=q.stride(0),
        s_qh=q.stride(1), s_kb=k.stride(0), s_kt=k.stride(1), s_kh=k.stride(2), TOPK=topk,
        BLOCK_ALL=max(16, pow2(a_stride)), CHUNK=chunk, BLOCK_N=block_n,
        BLOCK_D=block_d, GEO_BUF=from_buf, MMA=mma, PREC=prec, num_warps=warps)
    decode_combine_kernel[(B * H,)](
        PART_M=part_m, PART_L=part_l, PART_O=part_o, SEL_S=sel_s, O=out, H=H, D=D, N_WIN=n_win,
        N_SPAN=n_span, NPART=n_part, s_ob=out.stride(0), s_oh=out.stride(1), TOPK=topk,
        TOPK_PAD=max(2, pow2(topk)), BLOCK_P=16 if triton_interpreting() else 32,
        BLOCK_D=block_d, num_warps=4)
    return out


def _work_buffers(BH: int, a_stride: int, n_part: int, D: int, topk: int, device):
    f32 = dict(dtype=torch.float32, device=device)
    part_m = torch.empty(BH, n_part, **f32)
    return dict(scores=torch.empty(BH, a_stride, **f32), part_m=part_m,
                part_l=torch.empty_like(part_m), part_o=torch.empty(BH, n_part, D, **f32),
                sel_s=torch.empty(BH, topk, **f32))


@torch.no_grad()
def superlinear_decode_kernel(q, q_s, k_cache, v_cache, length: int, search_power=0.5,
                              span_power=0.5, topk=2, backward_factor=2.0, forward_factor=0.0,
                              sw_index=0, chunk: Optional[int] = None,
                              block_n: Optional[int] = None, warps: Optional[int] = None,
                              mma: Optional[bool] = None):
    """``ops.superlinear_decode_step`` on the kernels (arguments checked by the op).

    q, q_s: [B, H, D]; k_cache, v_cache: [B, L, H_kv, D] with positions [0, length) filled (only
    O(sqrt(length)) rows of them are read). Returns [B, H, D] in q's dtype. Eager: the step's
    integers are launch arguments and the grids fit this length (``SuperlinearDecodePlan`` is
    the form a CUDA graph captures). ``chunk``, ``block_n``, ``warps``, ``mma``: the split-K
    launch (``decode_chunk_default``, ``decode_tiles``), None for the defaults.
    """
    out_dtype = q.dtype
    B, H, D = q.shape
    k, v = k_cache, v_cache
    if out_dtype == torch.bfloat16 and triton_interpreting():
        # the interpreter (numpy) has no bf16: run on fp32 copies there only (CPU tests)
        q, q_s, k, v = (x.float() for x in (q, q_s, k[:, :length], v[:, :length]))
    q, q_s = q.contiguous(), q_s.contiguous()
    if k.stride(-1) != 1 or v.stride() != k.stride():  # the kernels share k's strides for v
        k, v = k.contiguous(), v.contiguous()
    geo = decode_geometry(length, search_power, span_power, backward_factor, forward_factor,
                          sw_index)
    _, offsets = decode_offsets(capacity_bucket(length), search_power, sw_index, q.device)
    chunk = chunk or decode_chunk_default()
    tiles = decode_tiles(chunk, D, block_n, warps, mma)
    n_win, n_span, n_part = _layout(geo, chunk, topk)
    work = _work_buffers(B * H, geo["a_stride"], n_part, D, topk, q.device)
    out = torch.empty(B, H, D, dtype=out_dtype, device=q.device)
    return _launch(q, q_s, k, v, out, geo, offsets, geo["a_stride"], n_win, n_span, topk, chunk,
                   tiles, geo_buf=None, **work)


class SuperlinearDecodePlan:
    """Decode steps at every length of one capacity bucket (C/2, C] (C a power of two) with
    fixed launches: the form a CUDA graph captures and replays.

    ``set_length(L)`` writes the step's integers (position, #candidates, window start, span
    extents: ``decode_geometry``, exact integer arithmetic on the host) into a device buffer
    with one host-to-device copy; ``run(q, q_s, k_cache, v_cache)`` launches the three kernels
    with grids and a part layout sized for the bucket's largest step (parts beyond a step's own
    are empty and merge as nothing), writes into ``self.out`` [B, H, D] and returns it. Every
    buffer is allocated here once, so ``run`` allocates nothing and syncs nothing. Results equal
    ``superlinear_decode_kernel`` at the same length bitwise (same parts, same merge order; the
    empty parts add exact zeros). Call ``set_length`` before each replay, outside the graph.
    """

    def __init__(self, batch: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device, search_power=0.5, span_power=0.5, topk=2,
                 backward_factor=2.0, forward_factor=0.0, sw_index=0,
                 chunk: Optional[int] = None, block_n: Optional[int] = None,
                 warps: Optional[int] = None, mma: Optional[bool] = None):
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"SuperlinearDecodePlan: capacity={capacity} is invalid: allowed a "
                             "power of two >= 1 (capacity_bucket(length))")
        if heads % kv_heads:
            raise ValueError(f"SuperlinearDecodePlan: heads={heads} is not a multiple of "
                             f"kv_heads={kv_heads}")
        self.capacity = capacity
        self.knobs = dict(search_power=search_power, span_power=span_power,
                          backward_factor=backward_factor, forward_factor=forward_factor,
                          sw_index=sw_index)
        self.topk = topk
        self.chunk = chunk or decode_chunk_default()
        self.tiles = decode_tiles(self.chunk, head_dim, block_n, warps, mma)
        _, self.offsets = decode_offsets(capacity, search_power, sw_index, device)
        largest = decode_geometry(capacity, **self.knobs)  # spans and window only grow with i
        self.a_stride = largest["a_stride"]
        w = superlinear_window(search_power, sw_index)
        self.n_win = cdiv(min(w, capacity), self.chunk) if w > 0 else 0
        self.n_span = _layout(largest, self.chunk, topk)[1]
        n_part = self.n_win + topk * self.n_span
        self.work = _work_buffers(batch * heads, self.a_stride, n_part, head_dim, topk, device)
        self.out = torch.empty(batch, heads, head_dim, dtype=dtype, device=device)
        self.geo = torch.zeros(5, dtype=torch.int32, device=device)
        self.length = None  # set_length's; None: no step set yet

    def set_length(self, length: int) -> None:
        """The next ``run`` computes the query at position length - 1 over keys [0, length)."""
        if not isinstance(length, int) or isinstance(length, bool) or \
                capacity_bucket(max(1, length)) != self.capacity or length < 1:
            raise ValueError(f"SuperlinearDecodePlan.set_length: length={length!r} is invalid: "
                             f"allowed an integer in [{self.capacity // 2 + 1}, {self.capacity}]"
                             " (this plan's capacity bucket; 1 for capacity 1)")
        geo = decode_geometry(length, **self.knobs)
        self.length = length
        host = torch.tensor([geo["pos"], geo["candidates"], geo["win_lo"], geo["back"],
                             geo["fwd"]], dtype=torch.int32)
        self.geo.copy_(host.pin_memory() if self.geo.is_cuda else host,
                       non_blocking=self.geo.is_cuda)

    @torch.no_grad()
    def run(self, q, q_s, k_cache, v_cache):
        """One step (q, q_s [B, H, D]; caches [B, L >= length, H_kv, D], the layouts the plan
        was made for) into ``self.out``; launches only."""
        if self.length is None:
            raise RuntimeError("SuperlinearDecodePlan.run: call set_length first")
        return _launch(q, q_s, k_cache, v_cache, self.out, None, self.offsets,
                       self.a_stride, self.n_win, self.n_span, self.topk, self.chunk,
                       self.tiles, geo_buf=self.geo, **self.work)
