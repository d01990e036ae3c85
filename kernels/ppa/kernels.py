"""PPA's Triton kernels: forward, and the backward split into dq and dk/dv (no atomics).

The mask of query i and key k (``d = i - k >= 0``) is ``d <= w`` or ``d in S_p``. The offsets are
split at a *dense reach* R >= w chosen on the host (``function.py``):

* ``d <= R``: dense tiles (tensor-core ``tl.dot``), masked by ``d <= R`` and, where R > w, by a
  lookup table ``ATTENDED[d]`` (int8, length R+1). This covers the window band and the small
  offsets whose diagonals lie close enough to fill a tile.
* ``d > R``: the remaining offsets ``FAR[j]`` (sorted). For a block of queries ``i`` an offset s
  meets the contiguous key rows ``i - s``: one diagonal, computed as row-wise dot products on the
  gathered rows (each query meets exactly one key per offset, so there is no tile to multiply).

Scores are kept in the log2 domain (``qk_scale = scale * log2(e)``, ``exp2``); ``LSE`` stores
``m + log2(l)`` per query for the backward. Tensors are ``[B, T, heads, D]`` with unit stride in
the last dim; ``LSE``/``DELTA`` are ``[B, H, T]`` fp32. Query head h reads key/value head h // G.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST multiplies fp32 copies of the (already rounded) operands:
    Triton's interpreter computes bf16 ``tl.dot`` wrongly, so CPU tests of bf16 set it."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _online_softmax_update(m_i, l_i, acc, scores, values, PREC: tl.constexpr,
                           UPCAST: tl.constexpr):
    """One step of the streaming softmax over a [BM, BN] score tile (log2 domain).

    ``values`` is the [BN, BD] value tile; returns the new (m_i, l_i, acc). Fully masked rows
    (-inf everywhere so far) stay at zero weight instead of producing NaN.
    """
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(values.dtype), values, PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def ppa_fwd_kernel(
    Q, K, V, O, LSE, ATTENDED, FAR, FAR_COUNT, SEQ_START,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    T, H, G, qk_scale, dense_reach,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_LOOKUP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    # late query blocks meet the most diagonals: launch them first (fewer stragglers)
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    rows_m = offs_m.to(tl.int64)

    if VARLEN:  # packed sequences: a query sees keys from the start of its own sequence on
        q_start = tl.load(SEQ_START + offs_m, mask=q_ok, other=T)
    else:
        q_start = tl.zeros([BLOCK_M], dtype=tl.int32)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    q = tl.load(q_base + rows_m[:, None] * stride_qt + offs_d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # (1) far offsets s > R: one gathered diagonal per offset (the older keys first)
    n_far = tl.load(FAR_COUNT + pid_m)
    for j in range(0, n_far):
        s = tl.load(FAR + j)
        kpos = offs_m - s
        ok = q_ok & (kpos >= q_start)
        rows_k = kpos.to(tl.int64)
        k = tl.load(k_base + rows_k[:, None] * stride_kt + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        score = tl.sum(q.to(tl.float32) * k.to(tl.float32), 1) * qk_scale
        score = tl.where(ok, score, float("-inf"))
        v = tl.load(v_base + rows_k[:, None] * stride_vt + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_i, score)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(score - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m_i = m_new

    # (2) dense tiles for offsets 0..R: keys [m0 - R, m0 + BLOCK_M)
    lo = tl.maximum(m0 - dense_reach, tl.min(q_start, 0))
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M, T)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows_n = offs_n.to(tl.int64)
        n_ok = offs_n < T
        k = tl.load(k_base + rows_n[:, None] * stride_kt + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        scores = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale
        dist = offs_m[:, None] - offs_n[None, :]
        ok = (dist >= 0) & (dist <= dense_reach) & (offs_n[None, :] >= q_start[:, None])
        if USE_LOOKUP:
            ok = ok & (tl.load(ATTENDED + dist, mask=ok, other=0) != 0)
        scores = tl.where(ok, scores, float("-inf"))
        v = tl.load(v_base + rows_n[:, None] * stride_vt + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, scores, v, PREC, UPCAST)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_base = O + b * stride_ob + h * stride_oh
    tl.store(o_base + rows_m[:, None] * stride_ot + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=q_ok[:, None] & d_ok[None, :])
    tl.store(LSE + (b * H + h) * T + offs_m, m_i + tl.log2(l_safe), mask=q_ok)


@triton.jit
def ppa_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, ATTENDED, FAR, FAR_COUNT, SEQ_START,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    T, H, G, qk_scale, scale, dense_reach,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_LOOKUP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """dq_i = scale * sum_k P_ik (dP_ik - delta_i) k_k, over the same key sets as the forward."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heavy blocks first, as in the forward
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    rows_m = offs_m.to(tl.int64)
    qd_mask = q_ok[:, None] & d_ok[None, :]

    if VARLEN:  # packed sequences: a query sees keys from the start of its own sequence on
        q_start = tl.load(SEQ_START + offs_m, mask=q_ok, other=T)
    else:
        q_start = tl.zeros([BLOCK_M], dtype=tl.int32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows_m[:, None] * stride_qt + offs_d[None, :],
                mask=qd_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows_m[:, None] * stride_dot
                 + offs_d[None, :], mask=qd_mask, other=0.0)
    lse = tl.load(LSE + (b * H + h) * T + offs_m, mask=q_ok, other=0.0)
    delta = tl.load(DELTA + (b * H + h) * T + offs_m, mask=q_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    n_far = tl.load(FAR_COUNT + pid_m)
    for j in range(0, n_far):
        s = tl.load(FAR + j)
        kpos = offs_m - s
        ok = q_ok & (kpos >= q_start)
        rows_k = kpos.to(tl.int64)
        k = tl.load(k_base + rows_k[:, None] * stride_kt + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_base + rows_k[:, None] * stride_vt + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        p = tl.exp2(tl.sum(q.to(tl.float32) * k, 1) * qk_scale - lse)
        p = tl.where(ok, p, 0.0)
        ds = p * (tl.sum(do.to(tl.float32) * v, 1) - delta)
        dq += ds[:, None] * k

    lo = tl.maximum(m0 - dense_reach, tl.min(q_start, 0))
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(m0 + BLOCK_M, T)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows_n = offs_n.to(tl.int64)
        n_ok = offs_n < T
        k = tl.load(k_base + rows_n[:, None] * stride_kt + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + rows_n[:, None] * stride_vt + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        dist = offs_m[:, None] - offs_n[None, :]
        ok = (dist >= 0) & (dist <= dense_reach) & (offs_n[None, :] >= q_start[:, None])
        ok = ok & q_ok[:, None]
        if USE_LOOKUP:
            ok = ok & (tl.load(ATTENDED + dist, mask=ok, other=0) != 0)
        scores = _dot(q, tl.trans(k), PREC, UPCAST) * qk_scale
        p = tl.where(ok, tl.exp2(scores - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), PREC, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PREC, UPCAST)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows_m[:, None] * stride_dqt + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def ppa_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, ATTENDED, FAR, FAR_COUNT, SEQ_END,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    T, H, G, qk_scale, scale, dense_reach,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_LOOKUP: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """dk, dv of one key block of one key/value head, summed over the G query heads of its group.

    Key k is attended by the queries k + d for dense d <= R (dense query tiles) and k + s for the
    far offsets (gathered diagonals): the transpose of the forward's structure.
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    H_kv = H // G
    b = (pid_bh // H_kv).to(tl.int64)
    hk = (pid_bh % H_kv).to(tl.int64)
    n0 = pid_n * BLOCK_N

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < T
    d_ok = offs_d < HEAD_DIM
    rows_n = offs_n.to(tl.int64)
    kd_mask = n_ok[:, None] & d_ok[None, :]

    k = tl.load(K + b * stride_kb + hk * stride_kh + rows_n[:, None] * stride_kt + offs_d[None, :],
                mask=kd_mask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + rows_n[:, None] * stride_vt + offs_d[None, :],
                mask=kd_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    n_far = tl.load(FAR_COUNT + pid_n)
    if VARLEN:  # packed sequences: a key is seen by queries before the end of its own sequence
        k_end = tl.load(SEQ_END + offs_n, mask=n_ok, other=0)
    else:
        k_end = tl.zeros([BLOCK_N], dtype=tl.int32) + T
    q_hi = tl.minimum(tl.minimum(n0 + BLOCK_N + dense_reach, T), tl.max(k_end, 0))

    for g in range(0, G):
        h = hk * G + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + (b * H + h) * T
        delta_base = DELTA + (b * H + h) * T

        # far offsets: queries k + s
        for j in range(0, n_far):
            s = tl.load(FAR + j)
            qpos = offs_n + s
            ok = n_ok & (qpos < k_end)
            rows_q = qpos.to(tl.int64)
            q = tl.load(q_base + rows_q[:, None] * stride_qt + offs_d[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            do = tl.load(do_base + rows_q[:, None] * stride_dot + offs_d[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            lse = tl.load(lse_base + qpos, mask=ok, other=0.0)
            delta = tl.load(delta_base + qpos, mask=ok, other=0.0)
            p = tl.where(ok, tl.exp2(tl.sum(k.to(tl.float32) * q, 1) * qk_scale - lse), 0.0)
            dv += p[:, None] * do
            ds = p * (tl.sum(v.to(tl.float32) * do, 1) - delta)
            dk += ds[:, None] * q

        # dense query tiles: queries [n0, n0 + BLOCK_N + R)
        lo = (n0 // BLOCK_M) * BLOCK_M
        for m0 in range(lo, q_hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows_m = offs_m.to(tl.int64)
            m_ok = offs_m < T
            q = tl.load(q_base + rows_m[:, None] * stride_qt + offs_d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_base + rows_m[:, None] * stride_dot + offs_d[None, :],
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
            dist = offs_m[None, :] - offs_n[:, None]  # [BLOCK_N, BLOCK_M]: query - key
            ok = (dist >= 0) & (dist <= dense_reach) & (offs_m[None, :] < k_end[:, None])
            ok = ok & n_ok[:, None]
            if USE_LOOKUP:
                ok = ok & (tl.load(ATTENDED + dist, mask=ok, other=0) != 0)
            scores_t = _dot(k, tl.trans(q), PREC, UPCAST) * qk_scale
            p_t = tl.where(ok, tl.exp2(scores_t - lse[None, :]), 0.0)
            dv += _dot(p_t.to(do.dtype), do, PREC, UPCAST)
            dp_t = _dot(v, tl.trans(do), PREC, UPCAST)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, PREC, UPCAST)

    tl.store(DK + b * stride_dkb + hk * stride_dkh + rows_n[:, None] * stride_dkt + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + rows_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kd_mask)
