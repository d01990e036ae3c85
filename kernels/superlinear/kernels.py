"""Triton kernels of Superlinear attention (N=2); the host side is ``function.py``.

Layouts: q, q_s ``[B, T, H, D]``, k, v ``[B, T, H_kv, D]`` (query head h reads key head
h // GROUP), contiguous. Statistics and per-pair outputs are float32. Every kernel takes fixed
block sizes (no autotuning: the same code runs under ``TRITON_INTERPRET=1``).

* ``search_topk_kernel``: one program per (query block, b*h). The candidate anchors of query i are
  i - d_a for the fixed offsets d_a (``ops.superlinear.anchor_offsets``), so for one offset the
  anchors of a query block are a contiguous run of keys: one masked row load per offset. Scores
  q_s . k are kept as a running top-k in registers (insertion in a [BLOCK_M, TOPK_PAD] tile; a
  later, i.e. farther, anchor enters only with a strictly larger score, so ties go to the nearer
  anchor as in the reference). Nothing of size #anchors is written to memory.
  ``search_topk_group_kernel`` (GQA): one program per (query, b*h_kv) scores all the group's
  query heads against a block of anchor keys in one tensor-core product, loading each key row
  once per group instead of once per head.
* The forward attention kernels keep scores in the log2 domain (``exp2``; their lse is
  converted back to natural log for the backward kernels, which use ``exp``).
* ``window_fwd_kernel`` / ``window_bwd_kernel``: causal sliding-window attention (keys
  [i - w + 1, i]) in flash style, returning the normalised output and its log-sum-exp; backward
  with the window's effective dO and D (see ``function.py``), dk/dv by atomic adds (GQA), or
  (launch option ``window_dkdv``) key-centric in ``window_bwd_dkdv_kernel``, without atomics.
* ``span_fwd_kernel`` / ``span_bwd_kernel``: one row per (query, kept anchor) *pair*. The pairs of
  a head are ordered by span start (host: a stable sort of the start, i.e. bucketed by key block),
  so a tile of BLOCK_M pairs reads one contiguous key footprint [min lo, max hi] in BLOCK_N blocks
  with per-row masks. The span part excludes window keys (the union S_t u W is de-duplicated);
  the host merges it with the window by log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _insert_topk(best_s, best_t, s, t, ok, slot, TOPK: tl.constexpr):
    """Insert one candidate per row (score s, anchor t; rows where ``ok``) into the rows' running
    top-k lists [R, TOPK_PAD], best first. Slots holding a score >= s stay ahead: candidates
    arrive nearest first, so a tie keeps the nearer anchor, as in the reference."""
    real_slot = slot[None, :] < TOPK
    # shift[j, j'] = (j' == j - 1): moves slot j-1 to slot j
    shift = slot[None, :] == (slot[:, None] - 1)
    pos = tl.sum(((best_s >= s[:, None]) & real_slot).to(tl.int32), axis=1)
    prev_s = tl.max(tl.where(shift[None, :, :], best_s[:, None, :], float("-inf")), axis=2)
    prev_t = tl.max(tl.where(shift[None, :, :], best_t[:, None, :], -1), axis=2)
    insert = ok[:, None] & real_slot
    here = slot[None, :] == pos[:, None]
    after = slot[None, :] > pos[:, None]
    best_s = tl.where(insert & here, s[:, None], tl.where(insert & after, prev_s, best_s))
    best_t = tl.where(insert & here, t[:, None], tl.where(insert & after, prev_t, best_t))
    return best_s, best_t


@triton.jit
def search_topk_kernel(QS, K, OFF, SEL_T, SEL_S, T, Q0, A, H, GROUP, D,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, TOPK: tl.constexpr,
                       TOPK_PAD: tl.constexpr):
    """T query rows at positions Q0 + row (Q0 > 0: a prefill chunk against cached keys)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < T
    d_mask = offs_d < D
    qs = tl.load(QS + b * s_qb + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :],
                 mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    slot = tl.arange(0, TOPK_PAD)
    best_s = tl.full([BLOCK_M, TOPK_PAD], float("-inf"), tl.float32)
    best_t = tl.full([BLOCK_M, TOPK_PAD], -1, tl.int32)
    last_query = Q0 + tl.minimum(pid_m * BLOCK_M + BLOCK_M, T) - 1
    for a in range(0, A):
        d = tl.load(OFF + a)
        if d <= last_query:  # offsets grow: later ones only reach later queries
            t = Q0 + offs_m - d
            ok = m_mask & (t >= 0)
            k = tl.load(K + b * s_kb + t[:, None] * s_kt + hk * s_kh + offs_d[None, :],
                        mask=ok[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            s = tl.sum(qs * k, axis=1)
            best_s, best_t = _insert_topk(best_s, best_t, s, t, ok, slot, TOPK)
    out = pid_bh * T * TOPK + offs_m[:, None] * TOPK + slot[None, :]
    out_mask = m_mask[:, None] & (slot[None, :] < TOPK)
    tl.store(SEL_T + out, best_t, mask=out_mask)
    tl.store(SEL_S + out, best_s, mask=out_mask)


@triton.jit
def search_topk_group_kernel(QS, K, OFF, SEL_T, SEL_S, T, Q0, A, H, GROUP, D,
                             s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                             BLOCK_G: tl.constexpr, BLOCK_A: tl.constexpr,
                             BLOCK_D: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                             PRECISION: tl.constexpr):
    """The search for GQA: one program per (query row, b * H_kv). The GROUP query heads of a
    KV head meet the same candidate keys (the anchors depend on the position only), so a block
    of BLOCK_A anchor rows is loaded once for the group and scored as one [BLOCK_G, BLOCK_A]
    tensor-core product, where ``search_topk_kernel`` loads it once per head. Each block's
    top-k (nearest first among equal scores) is then inserted into the running lists."""
    row = tl.program_id(0)
    pid_bk = tl.program_id(1)
    H_kv = H // GROUP
    b = pid_bk // H_kv
    hk = pid_bk % H_kv
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    qs = tl.load(QS + b * s_qb + row * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                 mask=g_ok[:, None] & d_mask[None, :], other=0.0)
    pos = Q0 + row
    slot = tl.arange(0, TOPK_PAD)
    best_s = tl.full([BLOCK_G, TOPK_PAD], float("-inf"), tl.float32)
    best_t = tl.full([BLOCK_G, TOPK_PAD], -1, tl.int32)
    for a0 in range(0, A, BLOCK_A):
        if tl.load(OFF + a0) <= pos:  # offsets grow: the rest of the table is out of reach
            offs_a = a0 + tl.arange(0, BLOCK_A)
            t = pos - tl.load(OFF + offs_a, mask=offs_a < A, other=pos + 1)
            ok = t >= 0
            k = tl.load(K + b * s_kb + t[:, None] * s_kt + hk * s_kh + offs_d[None, :],
                        mask=ok[:, None] & d_mask[None, :], other=0.0)
            s = tl.dot(qs, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_A]
            s = tl.where(ok[None, :], s, float("-inf"))
            for _ in tl.static_range(TOPK):  # the block's best, then its next best, ...
                best = tl.max(s, axis=1)
                nearest = tl.min(tl.where(s == best[:, None], offs_a[None, :], A), axis=1)
                picked = offs_a[None, :] == nearest[:, None]
                t_best = tl.max(tl.where(picked, t[None, :], -1), axis=1)
                best_s, best_t = _insert_topk(best_s, best_t, best, t_best,
                                              best > float("-inf"), slot, TOPK)
                s = tl.where(picked, float("-inf"), s)
    out = (b * H + heads[:, None]) * T * TOPK + row * TOPK + slot[None, :]
    out_mask = g_ok[:, None] & (slot[None, :] < TOPK)
    tl.store(SEL_T + out, best_t, mask=out_mask)
    tl.store(SEL_S + out, best_s, mask=out_mask)


@triton.jit
def _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, n_lo, n_hi, row_lo, row_hi, qk_scale,
                   TK, offs_n, offs_d, d_mask, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Online softmax (log2 domain) of the rows of q over the key blocks [n_lo, n_hi) in steps
    of BLOCK_N; returns (m_i, l_i, acc). MASKED: row r sees keys [row_lo[r], row_hi[r]] only;
    else the caller guarantees that every row sees every key of these blocks, and the masks'
    compares and the fully-masked-row guard are skipped."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + offs_n
        kv_mask = (cols < TK)[:, None] & d_mask[None, :]
        k = tl.load(k_base + cols[:, None] * s_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * s_kt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            inside = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] <= row_hi[:, None])
            s = tl.where(inside, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _blocks_split(first, last_excl, full_lo, full_hi, BLOCK_N: tl.constexpr):
    """Split the key blocks from ``first`` (a multiple of BLOCK_N) up to ``last_excl`` at the
    blocks lying wholly in [full_lo, full_hi] (every row sees them): returns (mid_lo, mid_hi),
    block-aligned, so that [first, mid_lo) and [mid_hi, last_excl) need masks and [mid_lo,
    mid_hi) does not."""
    end = tl.cdiv(last_excl, BLOCK_N) * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, first), end)
    mid_hi = tl.maximum(tl.minimum(((full_hi + 1) // BLOCK_N) * BLOCK_N, end), mid_lo)
    return mid_lo, mid_hi


@triton.jit
def window_fwd_kernel(Q, K, V, O, LSE, T, Q0, TK, H, GROUP, D, W, scale,
                      s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr):
    """T query rows at positions Q0 + row over TK keys (Q0 = 0, TK = T: the full op)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < T
    d_mask = offs_d < D
    q = tl.load(Q + b * s_qb + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = scale * LOG2E  # scores in the log2 domain (exp2); lse back in ln
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pos = Q0 + offs_m
    q_lo = Q0 + pid_m * BLOCK_M
    lo = tl.maximum(q_lo - W + 1, 0)  # W >= 1 (the host skips an empty window)
    hi = tl.minimum(q_lo + BLOCK_M, Q0 + T)
    first = (lo // BLOCK_N) * BLOCK_N
    # keys [q_lo + BLOCK_M - W, q_lo] lie in every row's window: no masks there
    mid_lo, mid_hi = _blocks_split(first, hi, q_lo + BLOCK_M - W, q_lo, BLOCK_N)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_kb + hk * s_kh
    row_lo = pos - W + 1
    m_i, l_i, acc = _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, first, mid_lo, row_lo,
                                   pos, qk_scale, TK, offs_n, offs_d, d_mask, BLOCK_N, True,
                                   PRECISION)
    m_i, l_i, acc = _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, mid_lo, mid_hi, row_lo,
                                   pos, qk_scale, TK, offs_n, offs_d, d_mask, BLOCK_N, False,
                                   PRECISION)
    m_i, l_i, acc = _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, mid_hi, hi, row_lo,
                                   pos, qk_scale, TK, offs_n, offs_d, d_mask, BLOCK_N, True,
                                   PRECISION)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    row = pid_bh * T + offs_m
    tl.store(O + row[:, None] * D + offs_d[None, :], o, mask=m_mask[:, None] & d_mask[None, :])
    tl.store(LSE + row, lse, mask=m_mask)


@triton.jit
def window_bwd_kernel(Q, K, V, DO, COEF, LSE, DELTA, DQ, DK, DV, T, H, GROUP, D, W, scale,
                      s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr, ATOMIC_KV: tl.constexpr, HAS_COEF: tl.constexpr):
    """The window's effective dO is ``DO[b, t, h] * COEF[b*h, t]`` (see ``_upstream``), LSE,
    DELTA its lse and D [B*H, T] (float32). DQ [B*H, T, D] is written; with ATOMIC_KV, DK, DV
    [B, T, H_kv, D] (float32) are accumulated atomically too (else ``window_bwd_dkdv_kernel``
    computes them)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < T
    d_mask = offs_d < D
    md_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * s_qb + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=md_mask, other=0.0)
    row = pid_bh * T + offs_m
    do = _upstream(DO, COEF, row, b, h, offs_m, 0, m_mask, D, s_ob, s_ot, s_oh, 0, BLOCK_D,
                   HAS_COEF)
    lse = tl.load(LSE + row, mask=m_mask, other=float("-inf"))
    delta = tl.load(DELTA + row, mask=m_mask, other=0.0)
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)  # no window keys: p = 0
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    q_lo = pid_m * BLOCK_M
    lo = tl.maximum(q_lo - W + 1, 0)  # W >= 1 (the host skips an empty window)
    hi = tl.minimum(q_lo + BLOCK_M, T)
    for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        # keys [i - W + 1, i] of query i (those past T are past every query)
        dq = _dq_key_block(q, do, lse_safe, delta, offs_m - W + 1, offs_m, m_mask, n0 + offs_n,
                           K, V, DK, DV, b, hk, T, H, GROUP, D, s_kb, s_kt, s_kh, scale, dq,
                           BLOCK_D, PRECISION, ATOMIC_KV)
    tl.store(DQ + row[:, None] * D + offs_d[None, :], dq, mask=md_mask)


@triton.jit
def _upstream(DO, COEF, coef_row, b, h, qi, slot, mask, D, s_ob, s_ot, s_oh, s_os,
              BLOCK_D: tl.constexpr, HAS_COEF: tl.constexpr):
    """Rows of the upstream gradient (float32 [rows, BLOCK_D]) at
    ``DO + b*s_ob + h*s_oh + qi*s_ot + slot*s_os``, times ``COEF[coef_row]`` if HAS_COEF.
    With the fused mixture the gradient of pair (i, slot) is gate * dO[i] and the window's is
    gamma * dO[i] (``function.py``), so the kernels read the model's dO [B, T, H, D] (s_os = 0)
    with a per-row coefficient instead of a materialised [B*H, T, k, D] float32 tensor."""
    offs_d = tl.arange(0, BLOCK_D)
    ptr = DO + b * s_ob + h * s_oh + (qi * s_ot + slot * s_os)[:, None] + offs_d[None, :]
    do = tl.load(ptr, mask=mask[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    if HAS_COEF:
        do = do * tl.load(COEF + coef_row, mask=mask, other=0.0)[:, None]
    return do


@triton.jit
def _dq_key_block(q, do, lse_safe, delta, key_lo, key_hi, row_live, cols, K, V, DK, DV, b, hk,
                  T, H, GROUP, D, s_kb, s_kt, s_kh, scale, dq, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr, ATOMIC_KV: tl.constexpr):
    """One key block ``cols`` of the query-centric backward (window queries or span pairs):
    dq += dS k, where row r has scores for keys [key_lo[r], key_hi[r]] if row_live[r]; with
    ATOMIC_KV, the block's dK, dV are added atomically to DK, DV [B, T, H_kv, D] (float32).
    Returns dq."""
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (cols < T)[:, None] & (offs_d < D)[None, :]
    k_ptr = b * s_kb + cols[:, None] * s_kt + hk * s_kh + offs_d[None, :]
    k = tl.load(K + k_ptr, mask=kv_mask, other=0.0)
    v = tl.load(V + k_ptr, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    inside = ((cols[None, :] >= key_lo[:, None]) & (cols[None, :] <= key_hi[:, None])
              & row_live[:, None])
    p = tl.where(inside, tl.exp(s - lse_safe[:, None]), 0.0)
    dp = tl.dot(do.to(v.dtype), tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None]) * scale
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    if ATOMIC_KV:
        dk = tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
        dv = tl.dot(tl.trans(p).to(q.dtype), do.to(q.dtype), input_precision=PRECISION)
        kv_out = (b * T + cols[:, None]) * (H // GROUP) * D + hk * D + offs_d[None, :]
        tl.atomic_add(DK + kv_out, dk, mask=kv_mask)
        tl.atomic_add(DV + kv_out, dv, mask=kv_mask)
    return dq


@triton.jit
def _key_block(K, V, pid_n, pid_bk, T, H, GROUP, D, s_kb, s_kt, s_kh,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The key-centric backward kernels' key block: (b, kv head, its key positions, their mask,
    the [BLOCK_N, BLOCK_D] mask, k and v tiles, offsets of DK/DV rows)."""
    h_kv = H // GROUP
    b = pid_bk // h_kv
    hk = pid_bk % h_kv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask = cols < T
    kv_mask = n_mask[:, None] & (offs_d < D)[None, :]
    k_ptr = b * s_kb + cols[:, None] * s_kt + hk * s_kh + offs_d[None, :]
    k = tl.load(K + k_ptr, mask=kv_mask, other=0.0)
    v = tl.load(V + k_ptr, mask=kv_mask, other=0.0)
    kv_out = (b * T + cols[:, None]) * h_kv * D + hk * D + offs_d[None, :]
    return b, hk, cols, n_mask, kv_mask, k, v, kv_out


@triton.jit
def _dkdv_tile(k, v, q, do, lse, delta, inside, scale, dk, dv, PRECISION: tl.constexpr):
    """dK, dV of a key block from one tile of queries (or pairs) with their dO, lse and
    D = rowsum(dO * O): transposed flash-attention backward (rows = keys); ``inside`` [keys,
    queries] says which scores exist. A query without any key (lse = -inf) adds nothing."""
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale
    p_t = tl.where(inside, tl.exp(s_t - lse_safe[None, :]), 0.0)
    dp_t = tl.dot(v, tl.trans(do.to(v.dtype)), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :]) * scale
    dv += tl.dot(p_t.to(q.dtype), do.to(q.dtype), input_precision=PRECISION)
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def window_bwd_dkdv_kernel(Q, K, V, DO, COEF, LSE, DELTA, DK, DV, T, H, GROUP, D, W, scale,
                           s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                           HAS_COEF: tl.constexpr):
    """grid (cdiv(T, BLOCK_N), B*H_kv): the window's dK, dV of one key block, key-centric (flash
    attention's backward): key j is in the window of the queries [j, j + W - 1], so the block
    meets the query blocks up to n0 + BLOCK_N + W - 2, of every query head of its group; dK, dV
    stay in registers and are added once to DK, DV [B, T, H_kv, D] (float32, holding the span
    part's sums already) — no atomics."""
    pid_n = tl.program_id(0)
    b, hk, cols, n_mask, kv_mask, k, v, kv_out = _key_block(
        K, V, pid_n, tl.program_id(1), T, H, GROUP, D, s_kb, s_kt, s_kh, BLOCK_N, BLOCK_D)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    hi = tl.minimum(n0 + BLOCK_N - 1 + W, T)  # one past the last query that sees the block
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        for m0 in range((n0 // BLOCK_M) * BLOCK_M, hi, BLOCK_M):
            rows = m0 + offs_m
            m_mask = rows < T
            md_mask = m_mask[:, None] & d_mask[None, :]
            q = tl.load(Q + b * s_qb + rows[:, None] * s_qt + h * s_qh + offs_d[None, :],
                        mask=md_mask, other=0.0)
            do = _upstream(DO, COEF, bh * T + rows, b, h, rows, 0, m_mask, D, s_ob, s_ot, s_oh,
                           0, BLOCK_D, HAS_COEF)
            lse = tl.load(LSE + bh * T + rows, mask=m_mask, other=float("-inf"))
            delta = tl.load(DELTA + bh * T + rows, mask=m_mask, other=0.0)
            inside = (rows[None, :] >= cols[:, None]) & (rows[None, :] < cols[:, None] + W)
            inside = inside & n_mask[:, None] & m_mask[None, :]
            dk, dv = _dkdv_tile(k, v, q, do, lse, delta, inside, scale, dk, dv, PRECISION)
    tl.store(DK + kv_out, tl.load(DK + kv_out, mask=kv_mask, other=0.0) + dk, mask=kv_mask)
    tl.store(DV + kv_out, tl.load(DV + kv_out, mask=kv_mask, other=0.0) + dv, mask=kv_mask)


@triton.jit
def span_fwd_kernel(Q, K, V, ORDER, LO, HI, O, LSE, O_W, LSE_W, T, P, H, GROUP, D, scale,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, MERGE: tl.constexpr):
    """Pairs p = i * TOPK + slot of head b*h, taken in the order ORDER [B*H, P]; LO/HI [B*H, P]
    (natural order) bound the span keys outside the window (empty if HI < LO). Writes the
    normalised span output O [B*H, P, D] and its lse [B*H, P] (natural order).

    MERGE (launch option ``fused_merge``): the window's output O_W [B*H, P / TOPK, D] and lse
    LSE_W [B*H, P / TOPK] (computed before) are merged in by log-sum-exp here, so O and LSE
    receive the pair's whole attention output and lse (a pair with neither: 0 and -inf)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs < P
    d_mask = offs_d < D
    pair = tl.load(ORDER + pid_bh * P + offs, mask=p_mask, other=0)
    qi = pair // TOPK
    lo = tl.load(LO + pid_bh * P + pair, mask=p_mask, other=T)
    hi = tl.load(HI + pid_bh * P + pair, mask=p_mask, other=-1)
    live = p_mask & (hi >= lo)
    q = tl.load(Q + b * s_qb + qi[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = scale * LOG2E  # scores in the log2 domain (exp2); lse back in ln
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    foot_lo = tl.min(tl.where(live, lo, T), axis=0)
    foot_hi = tl.max(tl.where(live, hi, -1), axis=0)
    first = (foot_lo // BLOCK_N) * BLOCK_N
    # keys [max lo, min hi] of the live pairs lie in every live pair's span: no masks there
    # (the other rows take them too, and are zeroed below)
    mid_lo, mid_hi = _blocks_split(first, foot_hi + 1, tl.max(tl.where(live, lo, -1), axis=0),
                                   tl.min(tl.where(live, hi, T), axis=0), BLOCK_N)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_kb + hk * s_kh
    m_i, l_i, acc = _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, first, mid_lo, lo, hi,
                                   qk_scale, T, offs_n, offs_d, d_mask, BLOCK_N, True, PRECISION)
    m_i, l_i, acc = _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, mid_lo, mid_hi, lo, hi,
                                   qk_scale, T, offs_n, offs_d, d_mask, BLOCK_N, False, PRECISION)
    m_i, l_i, acc = _softmax_steps(q, m_i, l_i, acc, k_base, v_base, s_kt, mid_hi, foot_hi + 1,
                                   lo, hi, qk_scale, T, offs_n, offs_d, d_mask, BLOCK_N, True,
                                   PRECISION)
    has = live & (l_i > 0)
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    if MERGE:
        row = pid_bh * (P // TOPK) + qi
        lse_w = tl.load(LSE_W + row, mask=p_mask, other=float("-inf"))
        o_w = tl.load(O_W + row[:, None] * D + offs_d[None, :],
                      mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        o, lse = _lse_merge(o, lse, o_w, lse_w)
    out = pid_bh * P + pair
    tl.store(O + out[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty),
             mask=p_mask[:, None] & d_mask[None, :])
    tl.store(LSE + out, lse, mask=p_mask)


@triton.jit
def _lse_merge(o, lse, o_w, lse_w):
    """Merge two normalised attention outputs over disjoint key sets by log-sum-exp: rows of
    (o, lse) and (o_w, lse_w) -> (o_merged, lse_merged); a row with neither gets 0 and -inf."""
    top = tl.maximum(lse, lse_w)
    finite = top > float("-inf")
    top_safe = tl.where(finite, top, 0.0)
    total = tl.exp(lse - top_safe) + tl.exp(lse_w - top_safe)  # >= 1 where finite
    merged = top_safe + tl.log(tl.where(finite, total, 1.0))
    merged_safe = tl.where(finite, merged, 0.0)
    w_s = tl.where(finite, tl.exp(lse - merged_safe), 0.0)
    w_w = tl.where(finite, tl.exp(lse_w - merged_safe), 0.0)
    return w_s[:, None] * o + w_w[:, None] * o_w, tl.where(finite, merged, float("-inf"))


@triton.jit
def span_bwd_kernel(Q, K, V, ORDER, LO, HI, DA, COEF, LSE, DELTA, DQ, DK, DV, T, P, H, GROUP, D,
                    scale, s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh, s_os,
                    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_KV: tl.constexpr,
                    HAS_COEF: tl.constexpr):
    """Backward of the span part of every pair: dL/dA of pair (i, slot) is
    ``DA[b, i, h, slot] * COEF[b*h, pair]`` (``_upstream``), LSE [B*H, P] its merged (span u
    window) lse and DELTA = rowsum(dA * A). Writes the pair's dq [B*H, P, D];
    with ATOMIC_KV, accumulates DK, DV [B, T, H_kv, D] (float32) atomically too (else
    ``span_bwd_dkdv_kernel`` computes them)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs < P
    d_mask = offs_d < D
    pd_mask = p_mask[:, None] & d_mask[None, :]
    pair = tl.load(ORDER + pid_bh * P + offs, mask=p_mask, other=0)
    qi = pair // TOPK
    lo = tl.load(LO + pid_bh * P + pair, mask=p_mask, other=T)
    hi = tl.load(HI + pid_bh * P + pair, mask=p_mask, other=-1)
    live = p_mask & (hi >= lo)
    q = tl.load(Q + b * s_qb + qi[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=pd_mask,
                other=0.0)
    row = pid_bh * P + pair
    da = _upstream(DA, COEF, row, b, h, qi, pair % TOPK, p_mask, D, s_ob, s_ot, s_oh, s_os,
                   BLOCK_D, HAS_COEF)
    lse = tl.load(LSE + row, mask=p_mask, other=float("-inf"))
    delta = tl.load(DELTA + row, mask=p_mask, other=0.0)
    lse_safe = tl.where(lse == float("-inf"), float("inf"), lse)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    foot_lo = tl.min(tl.where(live, lo, T), axis=0)
    foot_hi = tl.max(tl.where(live, hi, -1), axis=0)
    for n0 in range((foot_lo // BLOCK_N) * BLOCK_N, foot_hi + 1, BLOCK_N):
        dq = _dq_key_block(q, da, lse_safe, delta, lo, hi, live, n0 + offs_n, K, V, DK, DV, b,
                           hk, T, H, GROUP, D, s_kb, s_kt, s_kh, scale, dq, BLOCK_D, PRECISION,
                           ATOMIC_KV)
    tl.store(DQ + row[:, None] * D + offs_d[None, :], dq, mask=pd_mask)


@triton.jit
def span_bwd_dkdv_kernel(Q, K, V, ORDER, LO, HI, DA, COEF, LSE, DELTA, TILE_FIRST, TILE_END,
                         DK, DV, T, P, H, GROUP, D, NKB, scale,
                         s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_ob, s_ot, s_oh, s_os,
                         TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                         HAS_COEF: tl.constexpr, SORTED: tl.constexpr):
    """grid (NKB = cdiv(T, BLOCK_N), B*H_kv): the span part's dK, dV of one key block,
    key-centric. For each query head of the group, the pair tiles (BLOCK_M pairs of the sorted
    order, as in ``span_bwd_kernel``) that can reach the block are tiles [first, end) of
    TILE_FIRST / TILE_END [B*H, NKB] (host: search of the tiles' first span start and running
    maximum span end); dK, dV stay in registers and are added once to DK, DV [B, T, H_kv, D]
    (float32) — no atomics.

    SORTED (launch option ``sorted_pairs``): Q, DA [B*H, P, D] and LO, HI, LSE, DELTA
    [B*H, P] hold the pairs' rows already in the sorted order (``sort_pairs_kernel``), so a
    tile's loads are contiguous blocks at addresses known before any load — which the
    compiler can pipeline — instead of rows gathered through ORDER (a key block meets each
    tile once per visit, about 20 visits per tile at T = 32K)."""
    pid_n = tl.program_id(0)
    b, hk, cols, n_mask, kv_mask, k, v, kv_out = _key_block(
        K, V, pid_n, tl.program_id(1), T, H, GROUP, D, s_kb, s_kt, s_kh, BLOCK_N, BLOCK_D)
    offs_p = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        first = tl.load(TILE_FIRST + bh * NKB + pid_n)
        end = tl.load(TILE_END + bh * NKB + pid_n)
        for t in range(first, end):
            offs = t * BLOCK_M + offs_p
            p_mask = offs < P
            pd_mask = p_mask[:, None] & d_mask[None, :]
            if SORTED:
                row = bh * P + offs
                tile = row[:, None] * D + offs_d[None, :]
                q = tl.load(Q + tile, mask=pd_mask, other=0.0)
                da = tl.load(DA + tile, mask=pd_mask, other=0.0)
            else:
                pair = tl.load(ORDER + bh * P + offs, mask=p_mask, other=0)
                qi = pair // TOPK
                row = bh * P + pair
                q = tl.load(Q + b * s_qb + qi[:, None] * s_qt + h * s_qh + offs_d[None, :],
                            mask=pd_mask, other=0.0)
                da = _upstream(DA, COEF, row, b, h, qi, pair % TOPK, p_mask, D, s_ob, s_ot,
                               s_oh, s_os, BLOCK_D, HAS_COEF)
            lo = tl.load(LO + row, mask=p_mask, other=T)
            hi = tl.load(HI + row, mask=p_mask, other=-1)
            lse = tl.load(LSE + row, mask=p_mask, other=float("-inf"))
            delta = tl.load(DELTA + row, mask=p_mask, other=0.0)
            inside = (cols[:, None] >= lo[None, :]) & (cols[:, None] <= hi[None, :])
            inside = inside & (p_mask & (hi >= lo))[None, :] & n_mask[:, None]
            dk, dv = _dkdv_tile(k, v, q, da, lse, delta, inside, scale, dk, dv, PRECISION)
    tl.store(DK + kv_out, tl.load(DK + kv_out, mask=kv_mask, other=0.0) + dk, mask=kv_mask)
    tl.store(DV + kv_out, tl.load(DV + kv_out, mask=kv_mask, other=0.0) + dv, mask=kv_mask)


@triton.jit
def _row_tile(T, H, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Prologue shared by the per-row kernels (grid (cdiv(T, BLOCK_M), B*H)), written once."""
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < T
    d_mask = offs_d < D
    md_mask = m_mask[:, None] & d_mask[None, :]
    row = pid_bh * T + offs_m  # the rows' index into [B*H, T, ...] tensors
    return b, h, offs_m, m_mask, offs_d, d_mask, md_mask, row


@triton.jit
def mix_fwd_kernel(A, GATE, OUT, T, H, D, s_gb, s_gt, s_gh, s_ob, s_ot, s_oh,
                   TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (cdiv(T, BLOCK_M), B*H): the gated mixture OUT[b, t, h] = sum_slot GATE[b, t, h,
    slot] * A[b*h, t, slot] (A [B*H, T, TOPK, D], float32 or, in the forward-only prefill, the
    inputs' dtype; OUT [B, T, H, D] in its own dtype), in
    one pass instead of broadcast products and a sum over fp32 tensors. (The span/window merge
    stays in ``span_fwd_kernel``'s epilogue: merging here was not deterministic on the GPU.)"""
    b, h, offs_m, m_mask, offs_d, d_mask, md_mask, row = _row_tile(T, H, D, BLOCK_M, BLOCK_D)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for slot in tl.static_range(TOPK):
        g = tl.load(GATE + b * s_gb + offs_m * s_gt + h * s_gh + slot, mask=m_mask, other=0.0)
        a = tl.load(A + (row * TOPK + slot)[:, None] * D + offs_d[None, :], mask=md_mask,
                    other=0.0)
        acc += g[:, None] * a.to(tl.float32)
    tl.store(OUT + b * s_ob + offs_m[:, None] * s_ot + h * s_oh + offs_d[None, :],
             acc.to(OUT.dtype.element_ty), mask=md_mask)


@triton.jit
def mix_bwd_kernel(A, GATE, DO, LSE, LSE_W, DGATE, COEF, DELTA, GAMMA, DELTA_W, T, H, D,
                   s_gb, s_gt, s_gh, s_ob, s_ot, s_oh,
                   TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (cdiv(T, BLOCK_M), B*H): the mixture's backward and every per-row factor the span
    and window backward kernels need, from dO [B, T, H, D] and the saved A, gate, lse, lse_w:

    * DGATE [B, T, H, TOPK] (gate's layout) = g_slot = dO . A_slot;
    * per pair [B*H, T, TOPK]: COEF = gate (dA_slot = gate_slot dO) and DELTA = rowsum(dA_slot *
      A_slot) = gate_slot g_slot;
    * per query [B*H, T]: the window's dO_w = sum_slot c_slot dA_slot = GAMMA dO with
      GAMMA = sum_slot c_slot gate_slot, and DELTA_W = sum_slot c_slot DELTA_slot, where
      c_slot = e^{lse_w - lse_slot} (0 where either is -inf)."""
    b, h, offs_m, m_mask, offs_d, d_mask, md_mask, row = _row_tile(T, H, D, BLOCK_M, BLOCK_D)
    do = tl.load(DO + b * s_ob + offs_m[:, None] * s_ot + h * s_oh + offs_d[None, :],
                 mask=md_mask, other=0.0).to(tl.float32)
    lse_w = tl.load(LSE_W + row, mask=m_mask, other=float("-inf"))
    gamma = tl.zeros([BLOCK_M], tl.float32)
    delta_w = tl.zeros([BLOCK_M], tl.float32)
    for slot in tl.static_range(TOPK):
        gate_ptr = b * s_gb + offs_m * s_gt + h * s_gh + slot
        g = tl.load(GATE + gate_ptr, mask=m_mask, other=0.0)
        pair = row * TOPK + slot
        a = tl.load(A + pair[:, None] * D + offs_d[None, :], mask=md_mask, other=0.0)
        g_slot = tl.sum(do * a, axis=1)
        delta = g * g_slot
        tl.store(DGATE + gate_ptr, g_slot, mask=m_mask)
        tl.store(COEF + pair, g, mask=m_mask)
        tl.store(DELTA + pair, delta, mask=m_mask)
        lse = tl.load(LSE + pair, mask=m_mask, other=float("-inf"))
        both = (lse > float("-inf")) & (lse_w > float("-inf"))
        c = tl.where(both, tl.exp(lse_w - tl.where(both, lse, 0.0)), 0.0)
        gamma += c * g
        delta_w += c * delta
    tl.store(GAMMA + row, gamma, mask=m_mask)
    tl.store(DELTA_W + row, delta_w, mask=m_mask)


@triton.jit
def gate_bwd_kernel(QS, K, SEL_T, DS, DQS, DK, T, TK, H, GROUP, D,
                    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh,
                    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (cdiv(T, BLOCK_M), B*H): backward of the kept anchors' scores s_slot = q_s(i) . k(t)
    (t = SEL_T [B, H, T, TOPK], -1: no anchor) from their gradient DS [B, T, H, TOPK] (float32):
    DQS [B, T, H, D] (float32) = sum_slot ds_slot k(t_slot) is written; DK [B, TK, H_kv, D]
    (float32) += ds_slot q_s(i), atomically (queries share anchors). It replaces a gather of
    the kept keys into a [B, T, H, k, D] tensor and its scatter-add backward."""
    b, h, offs_m, m_mask, offs_d, d_mask, md_mask, row = _row_tile(T, H, D, BLOCK_M, BLOCK_D)
    hk = h // GROUP
    q_ptr = b * s_qb + offs_m[:, None] * s_qt + h * s_qh + offs_d[None, :]
    qs = tl.load(QS + q_ptr, mask=md_mask, other=0.0).to(tl.float32)
    dqs = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for slot in tl.static_range(TOPK):
        t = tl.load(SEL_T + row * TOPK + slot, mask=m_mask, other=-1)
        ds = tl.load(DS + ((b * T + offs_m) * H + h) * TOPK + slot, mask=m_mask, other=0.0)
        ok = m_mask & (t >= 0)
        kd_mask = ok[:, None] & d_mask[None, :]
        k = tl.load(K + b * s_kb + t[:, None] * s_kt + hk * s_kh + offs_d[None, :],
                    mask=kd_mask, other=0.0).to(tl.float32)
        dqs += ds[:, None] * k
        dk_ptr = ((b * TK + t) * (H // GROUP) + hk)[:, None] * D + offs_d[None, :]
        tl.atomic_add(DK + dk_ptr, ds[:, None] * qs, mask=kd_mask)
    tl.store(DQS + ((b * T + offs_m) * H + h)[:, None] * D + offs_d[None, :], dqs, mask=md_mask)


@triton.jit
def sort_pairs_kernel(SRC, COEF, ORDER, DST, P, H, D, s_b, s_t, s_h, s_s,
                      TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_COEF: tl.constexpr):
    """grid (cdiv(P, BLOCK_M), B*H): DST [B*H, P, D] (its dtype) row j = the row of pair
    ORDER[b*h, j] = (i, slot) of SRC at (b, i, h, slot) (``_upstream``'s addressing, times
    COEF[b*h, pair] if HAS_COEF): q or the pairs' dA in the span kernels' sorted order, for
    ``span_bwd_dkdv_kernel``'s SORTED loads."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs < P
    pair = tl.load(ORDER + pid_bh * P + offs, mask=p_mask, other=0)
    rows = _upstream(SRC, COEF, pid_bh * P + pair, b, h, pair // TOPK, pair % TOPK, p_mask, D,
                     s_b, s_t, s_h, s_s, BLOCK_D, HAS_COEF)
    tl.store(DST + (pid_bh * P + offs)[:, None] * D + offs_d[None, :],
             rows.to(DST.dtype.element_ty), mask=p_mask[:, None] & (offs_d < D)[None, :])
