"""Triton kernels of nonapprox: a causal softmax over time of one scalar per token, in chunks.

Per (batch, query head) with ``s_j = Σ_d SiLU(q_j)_d k_j_d / √D`` (k of the head's GQA group)::

    o_i = Σ_{j≤i} e^{s_j} v_j / Σ_{j≤i} e^{s_j},      lse_i = log Σ_{j≤i} e^{s_j}

No weight depends on the query, so this is a cumulative weighted mean — a memory-bound scan.
Chunks of ``BT`` tokens; every exponent below is ≤ 0 (nothing overflows, the running max keeps
the sums ≥ 1), and every reference used is an actual running max or lse, never a global one:

    forward   summary (parallel):   s, m_c = max_{j∈c} s_j, den_c = Σ e^{s_j − m_c}, num_c = Σ e^{s_j − m_c} v_j
              scan    (per head):   the state (max, den, num) entering each chunk, and the final one;
                                    blocks of NB chunks at a time as a [NB, NB] weight matrix
              output  (parallel):   ref_i = max(max_in, max_{j≤i in c} s_j),
                                    o_i = (e^{max_in − ref_i} num_in + Σ_{j≤i} e^{s_j − ref_i} v_j) / (same with den)
    backward  with p_ij = e^{s_j − lse_i} (i ≥ j; ≤ 1 since lse is non-decreasing) and δ_i = dO_i·o_i:
              dv_j = Σ_{i≥j} p_ij dO_i,   ds_j = v_j·dv_j − Σ_{i≥j} p_ij δ_i        (per query head)
              summary (parallel):   δ, and chunk c's Σ e^{R_{c−1} − lse_i} (dO_i, δ_i)  (R_c = lse at c's end)
              scan    (reverse):    A_c = Σ_{i after chunk c} e^{R_c − lse_i} (dO_i, δ_i)
                                    + e^{R_c − max_T} (dnum_T, −dden_T) (final state's grad)
              grads   (parallel):   the intra-chunk [BT, BT] p block plus e^{s_j − R_c} A_c;
                                    dq = ds k SiLU'(q) / √D,  dk = Σ_group ds SiLU(q) / √D,  dv = Σ_group dv

Per-token scalars (s, lse, δ) are fp32 ``[B, H, T]``; chunk summaries and states fp32. Matmul
operands of the ``[BT, BT] × [BT, D]`` products are cast to the input dtype (tensor cores for
bf16/fp16; fp32 inputs use ``input_precision="ieee"``), accumulations are fp32. Triton's
interpreter mis-computes bf16 dots, so there (only) they run in fp32 (``DOT_F32``).

Layout: q ``[B, T, H, D]``, k, v ``[B, T, H_kv, D]`` contiguous; D padded to a power of two ≥ 16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import operand as _operand, tile_raw as _tile_raw, tile as _tile


@triton.jit
def _silu(x):
    return x * tl.sigmoid(x)


# ------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------
@triton.jit
def nonapprox_fwd_summary_kernel(
    q_ptr, k_ptr, v_ptr, s_ptr, cmax_ptr, cden_ptr, cnum_ptr,
    T, H, HKV, G, D, NT, scale,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    """grid (NT, B*H): the scores s of chunk c and its own softmax summary (max, den, num)."""
    c, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    q = _tile(q_ptr + (b * T * H + h) * D, t0, T, H * D, d_cols, D, BT)
    k = _tile(k_ptr + (b * T * HKV + hk) * D, t0, T, HKV * D, d_cols, D, BT)
    s = tl.sum(_silu(q) * k, axis=1) * scale
    tl.store(s_ptr + pid_bh * T + rows, s, mask=row_ok)
    s = tl.where(row_ok, s, float("-inf"))
    m = tl.max(s, axis=0)  # finite: a chunk holds at least one token
    w = tl.exp(s - m)  # 0 on padded rows
    tl.store(cmax_ptr + pid_bh * NT + c, m)
    tl.store(cden_ptr + pid_bh * NT + c, tl.sum(w, axis=0))
    v_base = v_ptr + (b * T * HKV + hk) * D
    for v0 in range(0, D, BV):
        v_cols = v0 + tl.arange(0, BV)
        v = _tile(v_base, t0, T, HKV * D, v_cols, D, BT)
        tl.store(cnum_ptr + (pid_bh * NT + c) * D + v_cols, tl.sum(w[:, None] * v, axis=0),
                 mask=v_cols < D)


@triton.jit
def nonapprox_fwd_scan_kernel(
    cmax_ptr, cden_ptr, cnum_ptr, max0_ptr, den0_ptr, num0_ptr,
    imax_ptr, iden_ptr, inum_ptr, fmax_ptr, fden_ptr, fnum_ptr,
    D, NT,
    NB: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    """grid (cdiv(D, BV), B*H): the state (max, den, num) entering every chunk, and the final one.

    NB chunks at a time: chunk c of a block enters with reference E_c = max(carry max, m_{c'<c}),
    weights e^{m_c' − E_c} ≤ 1 for c' < c — a masked [NB, NB] matrix times the [NB, BV] nums.
    """
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    v_cols = pid_v * BV + tl.arange(0, BV)
    v_ok = v_cols < D
    if HAS_STATE:
        run_max = tl.load(max0_ptr + pid_bh)
        run_den = tl.load(den0_ptr + pid_bh)
        run_num = tl.load(num0_ptr + pid_bh * D + v_cols, mask=v_ok, other=0.0)
    else:
        run_max = tl.full([], float("-inf"), tl.float32)
        run_den = tl.full([], 0.0, tl.float32)
        run_num = tl.zeros([BV], dtype=tl.float32)
    idx = tl.arange(0, NB)
    before = idx[None, :] < idx[:, None]  # [c, c']: c' strictly before c
    for c0 in range(0, NT, NB):
        cs = c0 + idx
        ok = cs < NT
        m = tl.load(cmax_ptr + pid_bh * NT + cs, mask=ok, other=float("-inf"))
        den = tl.load(cden_ptr + pid_bh * NT + cs, mask=ok, other=0.0)
        num = tl.load(cnum_ptr + (pid_bh * NT + cs[:, None]) * D + v_cols[None, :],
                      mask=ok[:, None] & v_ok[None, :], other=0.0)
        logits = tl.where(before, m[None, :], float("-inf"))
        ref = tl.maximum(tl.max(logits, axis=1), run_max)  # -inf only before the first token
        ref_safe = tl.where(ref == float("-inf"), 0.0, ref)
        w = tl.exp(logits - ref_safe[:, None])
        carry = tl.exp(run_max - ref_safe)  # 0 while run_max = -inf
        in_den = carry * run_den + tl.sum(w * den[None, :], axis=1)
        in_num = carry[:, None] * run_num[None, :] + tl.dot(w, num, input_precision="ieee")
        if pid_v == 0:
            tl.store(imax_ptr + pid_bh * NT + cs, ref, mask=ok)
            tl.store(iden_ptr + pid_bh * NT + cs, in_den, mask=ok)
        tl.store(inum_ptr + (pid_bh * NT + cs[:, None]) * D + v_cols[None, :], in_num,
                 mask=ok[:, None] & v_ok[None, :])
        new_max = tl.maximum(run_max, tl.max(m, axis=0))  # finite: the block holds a chunk
        keep = tl.exp(run_max - new_max)
        wb = tl.exp(m - new_max)
        run_den = keep * run_den + tl.sum(wb * den, axis=0)
        run_num = keep * run_num + tl.sum(wb[:, None] * num, axis=0)
        run_max = new_max
    if STORE_FINAL:
        if pid_v == 0:
            tl.store(fmax_ptr + pid_bh, run_max)
            tl.store(fden_ptr + pid_bh, run_den)
        tl.store(fnum_ptr + pid_bh * D + v_cols, run_num, mask=v_ok)


@triton.jit
def nonapprox_fwd_out_kernel(
    v_ptr, s_ptr, imax_ptr, iden_ptr, inum_ptr, o_ptr, lse_ptr,
    T, H, HKV, G, D, NT,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """grid (cdiv(D, BV), NT, B*H): o of chunk c from its entering state, and lse (V-block 0)."""
    pid_v, c, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    s = tl.load(s_ptr + pid_bh * T + rows, mask=row_ok, other=float("-inf"))
    in_max = tl.load(imax_ptr + pid_bh * NT + c)
    in_den = tl.load(iden_ptr + pid_bh * NT + c)
    causal = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]
    logits = tl.where(causal, s[None, :], float("-inf"))  # [i, j]
    ref = tl.maximum(tl.max(logits, axis=1), in_max)  # finite: j = i is in (padded rows: j = t0)
    w = tl.exp(logits - ref[:, None])
    carry = tl.exp(in_max - ref)
    den = carry * in_den + tl.sum(w, axis=1)  # >= 1
    if pid_v == 0:
        tl.store(lse_ptr + pid_bh * T + rows, ref + tl.log(den), mask=row_ok)
    v_cols = pid_v * BV + tl.arange(0, BV)
    v = _tile(v_ptr + (b * T * HKV + hk) * D, t0, T, HKV * D, v_cols, D, BT)
    in_num = tl.load(inum_ptr + (pid_bh * NT + c) * D + v_cols, mask=v_cols < D, other=0.0)
    num = carry[:, None] * in_num[None, :] + tl.dot(_operand(w, v_ptr, DOT_F32),
                                                    _operand(v, v_ptr, DOT_F32),
                                                    input_precision=PREC)
    o = num / den[:, None]
    o_ptrs = o_ptr + ((b * T + rows[:, None]) * H + h) * D + v_cols[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (v_cols[None, :] < D))


# ------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------
@triton.jit
def nonapprox_bwd_summary_kernel(
    do_ptr, o_ptr, lse_ptr, delta_ptr, cdo_ptr, cdelta_ptr,
    T, H, D, NT,
    BT: tl.constexpr, BD: tl.constexpr,
):
    """grid (NT, B*H): δ_i = dO_i·o_i, and chunk c's Σ e^{R_{c−1} − lse_i} (dO_i, δ_i) relative to
    the lse just before it (chunk 0 uses its first token's; its summary is never read)."""
    c, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    base = (b * T * H + h) * D
    do = _tile(do_ptr + base, t0, T, H * D, d_cols, D, BT)
    o = _tile(o_ptr + base, t0, T, H * D, d_cols, D, BT)
    delta = tl.sum(do * o, axis=1)
    tl.store(delta_ptr + pid_bh * T + rows, delta, mask=row_ok)
    lse = tl.load(lse_ptr + pid_bh * T + rows, mask=row_ok, other=float("inf"))
    ref = tl.load(lse_ptr + pid_bh * T + tl.maximum(t0 - 1, 0))
    w = tl.exp(ref - lse)  # <= 1; 0 on padded rows
    tl.store(cdelta_ptr + pid_bh * NT + c, tl.sum(w * delta, axis=0))
    tl.store(cdo_ptr + (pid_bh * NT + c) * D + d_cols, tl.sum(w[:, None] * do, axis=0),
             mask=d_cols < D)


@triton.jit
def nonapprox_bwd_scan_kernel(
    lse_ptr, cdo_ptr, cdelta_ptr, ado_ptr, adelta_ptr, fmax_ptr, gdo_ptr, gdelta_ptr,
    T, D, NT,
    BT: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr, HAS_FINAL: tl.constexpr,
):
    """grid (cdiv(D, BV), B*H): A_c = Σ_{i after chunk c} e^{R_c − lse_i} (dO_i, δ_i), R_c = lse at
    the end of chunk c. From the last block of NB chunks to the first; chunk c' > c contributes
    its summary with weight e^{R_c − R_{c'−1}} ≤ 1.
    HAS_FINAL: the final state's gradient (num: gdo_ptr [B*H, D], den: gdelta_ptr = −dden
    [B*H]) enters as one more term after the last token, relative to the final max (fmax_ptr
    [B*H]): the final (num, den) weigh token j by e^{s_j − max}, as a query after the end with
    lse = max would (e^{R_c − max} ≤ the final den, no overflow)."""
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    v_cols = pid_v * BV + tl.arange(0, BV)
    v_ok = v_cols < D
    idx = tl.arange(0, NB)
    after = idx[None, :] > idx[:, None]  # [c, c']: c' strictly after c
    # the carry: Σ over chunks >= the current block's end, relative to carry_ref
    if HAS_FINAL:
        carry_ref = tl.load(fmax_ptr + pid_bh)
        carry_do = tl.load(gdo_ptr + pid_bh * D + v_cols, mask=v_ok, other=0.0)
        carry_delta = tl.load(gdelta_ptr + pid_bh)
    else:
        carry_ref = tl.full([], float("inf"), tl.float32)  # nothing yet: e^{x − inf} = 0
        carry_do = tl.zeros([BV], dtype=tl.float32)
        carry_delta = tl.full([], 0.0, tl.float32)
    n_blocks = tl.cdiv(NT, NB)
    for blk in range(n_blocks):
        c0 = (n_blocks - 1 - blk) * NB
        cs = c0 + idx
        ok = cs < NT
        r_end = tl.load(lse_ptr + pid_bh * T + tl.minimum((cs + 1) * BT, T) - 1, mask=ok,
                        other=0.0)  # R_c
        r_before = tl.load(lse_ptr + pid_bh * T + tl.maximum(cs * BT - 1, 0), mask=ok,
                           other=0.0)  # R_{c-1}: the reference of c's summary
        sdo = tl.load(cdo_ptr + (pid_bh * NT + cs[:, None]) * D + v_cols[None, :],
                      mask=ok[:, None] & v_ok[None, :], other=0.0)
        sdelta = tl.load(cdelta_ptr + pid_bh * NT + cs, mask=ok, other=0.0)
        w = tl.where(after & ok[None, :], tl.exp(tl.minimum(r_end[:, None] - r_before[None, :], 0.0)), 0.0)
        from_carry = tl.exp(r_end - carry_ref)
        a_do = tl.dot(w, sdo, input_precision="ieee") + from_carry[:, None] * carry_do[None, :]
        a_delta = tl.sum(w * sdelta[None, :], axis=1) + from_carry * carry_delta
        tl.store(ado_ptr + (pid_bh * NT + cs[:, None]) * D + v_cols[None, :], a_do,
                 mask=ok[:, None] & v_ok[None, :])
        if pid_v == 0:
            tl.store(adelta_ptr + pid_bh * NT + cs, a_delta, mask=ok)
        # carry for the next (earlier) block, relative to R_{c0-1} (the first chunk's r_before)
        new_ref = tl.load(lse_ptr + pid_bh * T + tl.maximum(c0 * BT - 1, 0))
        wb = tl.where(ok, tl.exp(new_ref - r_before), 0.0)
        keep = tl.exp(new_ref - carry_ref)
        carry_do = keep * carry_do + tl.sum(wb[:, None] * sdo, axis=0)
        carry_delta = keep * carry_delta + tl.sum(wb * sdelta, axis=0)
        carry_ref = new_ref


@triton.jit
def nonapprox_bwd_grad_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, s_ptr, lse_ptr, delta_ptr, ado_ptr, adelta_ptr,
    dq_ptr, dk_ptr, dv_ptr,
    T, H, HKV, G, D, NT, scale,
    BT: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """grid (NT, B*H_kv): dq of the group's G query heads, dk and dv summed over them. Tiles stay
    in the stored dtype (registers) and are widened to fp32 where they enter arithmetic."""
    c, pid_bk = tl.program_id(0), tl.program_id(1)
    b, hk = pid_bk // HKV, pid_bk % HKV
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    kv_base = (b * T * HKV + hk) * D
    k = _tile_raw(k_ptr + kv_base, t0, T, HKV * D, d_cols, D, BT)
    v = _tile_raw(v_ptr + kv_base, t0, T, HKV * D, d_cols, D, BT)
    causal = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]  # [i, j]: j <= i
    valid = causal & row_ok[:, None]
    dk = tl.zeros([BT, BD], dtype=tl.float32)
    dv = tl.zeros([BT, BD], dtype=tl.float32)
    for g in range(G):
        h = hk * G + g
        bh = b * H + h
        q_base = (b * T * H + h) * D
        do = _tile_raw(do_ptr + q_base, t0, T, H * D, d_cols, D, BT)
        s = tl.load(s_ptr + bh * T + rows, mask=row_ok, other=float("-inf"))
        lse = tl.load(lse_ptr + bh * T + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(delta_ptr + bh * T + rows, mask=row_ok, other=0.0)
        r_end = tl.load(lse_ptr + bh * T + tl.minimum(t0 + BT, T) - 1)  # R_c
        a_do = tl.load(ado_ptr + (bh * NT + c) * D + d_cols, mask=d_cols < D, other=0.0)
        a_delta = tl.load(adelta_ptr + bh * NT + c)
        # exponents are <= 0 where valid (lse_i >= s_j for j <= i); clamped so that the masked
        # entries do not overflow before the mask drops them
        p = tl.where(valid, tl.exp(tl.minimum(s[None, :] - lse[:, None], 0.0)), 0.0)  # [i, j]
        later = tl.where(row_ok, tl.exp(s - r_end), 0.0)  # weight of the later chunks' sum
        dv_h = tl.dot(tl.trans(_operand(p, do_ptr, DOT_F32)), _operand(do, do_ptr, DOT_F32),
                      input_precision=PREC) + later[:, None] * a_do[None, :]
        ds = tl.sum(v.to(tl.float32) * dv_h, axis=1) - tl.sum(p * delta[:, None], axis=0)
        ds = (ds - later * a_delta) * scale
        dv += dv_h
        q = _tile(q_ptr + q_base, t0, T, H * D, d_cols, D, BT)
        sig = tl.sigmoid(q)
        dk += ds[:, None] * (q * sig)
        dq = ds[:, None] * k.to(tl.float32) * (sig * (1.0 + q * (1.0 - sig)))
        tl.store(dq_ptr + q_base + rows[:, None] * (H * D) + d_cols[None, :],
                 dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & (d_cols[None, :] < D))
    out_mask = row_ok[:, None] & (d_cols[None, :] < D)
    offs = kv_base + rows[:, None] * (HKV * D) + d_cols[None, :]
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=out_mask)
