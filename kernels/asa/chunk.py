"""Triton kernels of causal ASA: chunked linear attention with the softmax feature maps fused in.

Per (batch, query head), with chunks of ``BT`` tokens, ``q' = softmax(q P_Q)`` and
``k' = softmax(k P_K)`` are computed in registers from q, k and the head's ``P`` (never written
to HBM)::

    forward   states:  S_c = S_0 + Σ_{chunks < c} k'ᵀ v,   z_c = z_0 + Σ k'   (a scan over c)
              output:  num = tril(q' k'ᵀ) v + q' S_c,  den = tril(q' k'ᵀ) 1 + q' z_c
                       o = num / den  (linear) | num (none) | num / (i+1) (mean)
    backward  g = dO / den, r = -(dO·o) / den (linear; r = 0 otherwise),
              reverse states: dS_c = Σ_{chunks > c} q'ᵀ g,  dz_c = Σ_{chunks > c} q'ᵀ r
              (+ the final state's gradient dS_T, dz_T when a loss uses it); the initial
              state's gradient is the reverse sums past the first chunk (dS_T + Σ_c q'ᵀ g)

The scans run either as per-chunk deltas (parallel) plus a streaming prefix sum (default; the S
and z sums in one launch with cfg ``fused_scan``, on by default), or as one fused loop over
chunks per head (``scan="sequential"``); the output and gradient kernels are parallel over
blocks of RB rows of a chunk (cfg ``out_rows``, ``bwd_rows``), each block meeting the earlier
(or later) blocks of its chunk in RB × RB tiles. Backward, per chunk:
                          dA = tril(g vᵀ + r 1ᵀ)
                          dq' = dA k' + g S_cᵀ + r z_cᵀ        dk' = dAᵀ q' + v dS_cᵀ + 1 dz_cᵀ
                          dv  = tril(q' k'ᵀ)ᵀ g + k' dS_c
                          dℓ = f ⊙ (df − Σ_m f ⊙ df)  (softmax), dq = dℓ_q P_Qᵀ, dk = dℓ_k P_Kᵀ
              dP_Q = Σ qᵀ dℓ_q, dP_K = Σ kᵀ dℓ_k: partial sums over groups of chunks (a small
              kernel), added up in torch — deterministic, no atomics.

Matmul operands are cast to the input dtype (bf16/fp16 tensor cores, or fp32 with
``input_precision="ieee"``); every accumulation (dots, states, softmax) is fp32. The chunk states
``S_c, z_c`` (fp32 unless cfg ``states_half``, ``[B, H, NT, m, Dv]``) are written by the scan and
read by the output kernel; the forward keeps them for the backward (cfg ``keep_states``, the
default), which otherwise recomputes them. dℓ goes from the gradient kernel to the dP kernel in
the inputs' dtype (cfg ``dl_half``, the default) or fp32.

Packed sequences (``VARLEN``, B = 1): chunk c is row c of a host-built table (start, stop,
seq_start, seq_stop) whose chunks never straddle a sequence boundary; tiles are masked at the
chunk's stop, the parallel scans restart at each sequence, and "mean" counts from seq_start.

Head dim (cfg ``BDT``): every kernel that computes features (q P_Q, k P_K) accumulates the logits
over D tiles of BDT columns, dq = dℓ P_Qᵀ and dk = dℓ P_Kᵀ are written per D tile and the dP
kernel runs one program per D tile, so d_h = 512 never puts a [BT, 512] or [512, m] tile in one
program; BDT = BD (the interpreter's default, and compiled d_h ≤ 128) is the untiled code.

Padding: D, m and Dv are padded to powers of two ≥ 16 (``tl.dot``'s minimum) with masked loads;
padded features get logit −inf (feature value 0), padded tokens (t ≥ T) get k' = q' = 0 so they add
nothing to any state.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _softmax_of_logits(logits, feat_mask, row_mask):
    """softmax over features of fp32 logits ``[BT, BM]``; padded features 0, masked rows 0."""
    logits = tl.where(feat_mask[None, :], logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    f = e / tl.sum(e, axis=1)[:, None]
    return tl.where(row_mask[:, None], f, 0.0)


@triton.jit
def _load_rows(ptr, t0, T, stride_t, cols, n_cols, BT: tl.constexpr):
    """A ``[BT, len(cols)]`` tile of rows t0..t0+BT of a [T, ...] slice (zeros outside)."""
    rows = t0 + tl.arange(0, BT)
    mask = (rows[:, None] < T) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _load_p_rows(p_ptr, h, d_rows, D, M, BM: tl.constexpr):
    """Rows ``d_rows`` of the head's P ``[len(d_rows), BM]`` (contiguous [H, D, m]), zero-padded."""
    m = tl.arange(0, BM)
    mask = (d_rows[:, None] < D) & (m[None, :] < M)
    return tl.load(p_ptr + h * D * M + d_rows[:, None] * M + m[None, :], mask=mask, other=0.0)


@triton.jit
def _load_p(p_ptr, h, D, M, BD: tl.constexpr, BM: tl.constexpr):
    """The head's P ``[BD, BM]`` (contiguous [H, D, m] parameter), zero-padded."""
    return _load_p_rows(p_ptr, h, tl.arange(0, BD), D, M, BM)


@triton.jit
def _p_whole(p_ptr, h, D, M, dt, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr):
    """The head's whole P ``[BD, BM]`` in ``dt`` when D is one tile (BDT = BD: loaded once per
    program and kept, as before the D tiling); else a placeholder (0), the tiles of P being
    loaded where they are used (``_features``, ``_feature_grad_store``)."""
    if BDT == BD:
        p = _load_p(p_ptr, h, D, M, BD, BM).to(dt)
    else:
        p = 0.0
    return p


@triton.jit
def _features(x_base, t0, t_stop, x_stride, p, p_ptr, h, D, M, feat_mask, row_mask, dt,
              BT: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr,
              PREC: tl.constexpr):
    """The softmax features of rows t0..t0+BT of x (q or k, ``[T, D]`` with row stride
    ``x_stride``), fp32 ``[BT, BM]``: the logits x P accumulate over D tiles of BDT columns (a
    ``[BT, BDT]`` slice of x and ``[BDT, BM]`` of P live at a time, so that d_h = 512 fits a
    program's registers); with BDT = BD, one tile and ``p`` the whole P (``_p_whole``), the same
    operations as before the tiling. The D tiles are a runtime loop, not ``tl.static_range``:
    unrolled, the compiler kept every tile's loads live (sm_90 compile, d_h 512, BDT 128: 5.4 KB
    of spills per thread in the state scan, 4.8 KB in the output kernel; looped 0.9 and 1.0)."""
    if BDT == BD:
        x = _load_rows(x_base, t0, t_stop, x_stride, tl.arange(0, BD), D, BT).to(dt)
        logits = tl.dot(x, p, input_precision=PREC)
    else:
        logits = tl.zeros([BT, BM], dtype=tl.float32)
        for d0 in range(0, BD, BDT):
            d_cols = d0 + tl.arange(0, BDT)
            x = _load_rows(x_base, t0, t_stop, x_stride, d_cols, D, BT).to(dt)
            p_t = _load_p_rows(p_ptr, h, d_cols, D, M, BM).to(dt)
            logits += tl.dot(x, p_t, input_precision=PREC)
    return _softmax_of_logits(logits, feat_mask, row_mask)


@triton.jit
def _chunk_span(chunks_ptr, c, T, BT: tl.constexpr, VARLEN: tl.constexpr):
    """Chunk c's tokens ``[start, stop)`` and the start of its sequence.

    Dense: ``[c·BT, min(c·BT + BT, T))`` of the one sequence. VARLEN (packed sequences, B = 1):
    row c of the host-built chunk table ``[NT, 4]`` int32 (start, stop, seq_start, seq_stop);
    chunks never straddle a sequence boundary, so masking rows ``≥ stop`` keeps every tile inside
    one sequence."""
    if VARLEN:
        start = tl.load(chunks_ptr + c * 4)
        stop = tl.load(chunks_ptr + c * 4 + 1)
        seq_start = tl.load(chunks_ptr + c * 4 + 2)
    else:
        start = c * BT
        stop = T
        seq_start = 0
    return start, stop, seq_start


# ------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------
@triton.jit
def _token_rows(b, rows, h, B, T, H, TMAJOR: tl.constexpr):
    """Row indices (in units of the last dim) of tokens ``rows`` of batch b, head h in a
    ``[B, T, H, ·]`` tensor whose memory is ``[T, B, H, ·]`` (TMAJOR: a transposed view of
    Megatron's ``[s, b, h, d]``, so that its gradients flow back without copies) or
    ``[B, T, H, ·]``. o, dO, dq, dk and dv share the layout; dℓ stays ``[B, T, H, M]``."""
    if TMAJOR:
        return (rows * B + b) * H + h
    return (b * T + rows) * H + h


@triton.jit
def asa_fwd_states_kernel(
    k_ptr, v_ptr, pk_ptr, s0_ptr, z0_ptr, states_ptr, zs_ptr, st_ptr, zt_ptr,
    T, H, G, D, M, DV, NT,
    skb, skt, skh, svb, svt, svh,
    BT: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr,
):
    """grid (cdiv(Dv, BV), B*H): S_c, z_c before every chunk c (and the final state)."""
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    dt = k_ptr.dtype.element_ty
    m_idx = tl.arange(0, BM)
    v_cols = pid_v * BV + tl.arange(0, BV)
    feat_mask = m_idx < M
    p = _p_whole(pk_ptr, h, D, M, dt, BD, BDT, BM)
    sv_mask = feat_mask[:, None] & (v_cols[None, :] < DV)
    # states: [B, H, NT, M, DV]; zs: [B, H, NT, M]
    s_off = m_idx[:, None] * DV + v_cols[None, :]
    S = tl.zeros([BM, BV], dtype=tl.float32)
    z = tl.zeros([BM], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0_ptr + pid_bh * M * DV + s_off, mask=sv_mask, other=0.0)
        z = tl.load(z0_ptr + pid_bh * M + m_idx, mask=feat_mask, other=0.0)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    for c in range(NT):
        out = pid_bh * NT + c
        tl.store(states_ptr + out * M * DV + s_off, S, mask=sv_mask)
        if pid_v == 0:
            tl.store(zs_ptr + out * M + m_idx, z, mask=feat_mask)
        t0 = c * BT
        row_mask = (t0 + tl.arange(0, BT)) < T
        vc = _load_rows(v_base, t0, T, svt, v_cols, DV, BT).to(dt)
        kf = _features(k_base, t0, T, skt, p, pk_ptr, h, D, M, feat_mask, row_mask, dt, BT, BD,
                       BDT, BM, PREC)
        S += tl.dot(tl.trans(kf.to(dt)), vc, input_precision=PREC)
        z += tl.sum(kf, axis=0)
    if STORE_FINAL:
        tl.store(st_ptr + pid_bh * M * DV + s_off, S, mask=sv_mask)
        if pid_v == 0:
            tl.store(zt_ptr + pid_bh * M + m_idx, z, mask=feat_mask)


@triton.jit
def _out_tile(num, den, qf, p_k, pk_ptr, h, k_base, v_base, k0, t_stop, skt, svt, v_cols, D, M,
              DV, feat_mask, below, RB: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr,
              BM: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    """One RB × RB tile of the output kernel: a block of queries against the keys k0..k0+RB of
    their chunk, all of them when the tile is ``below`` the diagonal, else causal (the query
    block's own keys). Returns (num, den) with the tile's terms added."""
    dt = qf.dtype
    key_mask = (k0 + tl.arange(0, RB)) < t_stop
    vc = _load_rows(v_base, k0, t_stop, svt, v_cols, DV, RB).to(dt)
    kf = _features(k_base, k0, t_stop, skt, p_k, pk_ptr, h, D, M, feat_mask, key_mask, dt, RB,
                   BD, BDT, BM, PREC).to(dt)
    causal = tl.arange(0, RB)[:, None] >= tl.arange(0, RB)[None, :]
    A = tl.where(causal | below, tl.dot(qf, tl.trans(kf), input_precision=PREC), 0.0)
    num += tl.dot(A.to(dt), vc, input_precision=PREC)
    if NORM == 0:
        den += tl.sum(A, axis=1)
    return num, den


@triton.jit
def asa_fwd_out_kernel(
    q_ptr, k_ptr, v_ptr, pq_ptr, pk_ptr, states_ptr, zs_ptr, seen_ptr, o_ptr, den_ptr,
    chunks_ptr, T, H, G, D, M, DV, NT,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    BT: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr,
    BV: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
    B=1, TMAJOR: tl.constexpr = False,
):
    """grid (NT · BT/RB, cdiv(Dv, BV), B*H): the output of one block of RB rows of a chunk
    (RB = BT: the whole chunk; cfg out_rows), meeting the chunk's keys up to its own block in
    RB × RB tiles. NORM: 0 linear, 1 none, 2 mean.
    o: [B, T, H, DV], memory [T, B, H, DV] when TMAJOR (``_token_rows``); den: [B, H, T] fp32
    (linear: q'·z_i; mean: i+1, i counted from the start of the token's sequence)."""
    pid, pid_v, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB: tl.constexpr = BT // RB
    c, own = pid // NB, pid % NB
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    dt = q_ptr.dtype.element_ty
    t0, t_stop, seq_start = _chunk_span(chunks_ptr, c, T, BT, VARLEN)
    r0 = t0 + own * RB
    rows = r0 + tl.arange(0, RB)
    row_mask = rows < t_stop
    m_idx = tl.arange(0, BM)
    v_cols = pid_v * BV + tl.arange(0, BV)
    feat_mask = m_idx < M
    qf32 = _features(q_ptr + b * sqb + h * sqh, r0, t_stop, sqt,
                     _p_whole(pq_ptr, h, D, M, dt, BD, BDT, BM), pq_ptr, h, D, M, feat_mask,
                     row_mask, dt, RB, BD, BDT, BM, PREC)
    qf = qf32.to(dt)
    st = pid_bh * NT + c
    sv_mask = feat_mask[:, None] & (v_cols[None, :] < DV)
    S = tl.load(states_ptr + st * M * DV + m_idx[:, None] * DV + v_cols[None, :], mask=sv_mask,
                other=0.0)
    num = tl.dot(qf, S.to(dt), input_precision=PREC)
    if NORM == 0:
        z = tl.load(zs_ptr + st * M + m_idx, mask=feat_mask, other=0.0)
        den = tl.sum(qf32 * z[None, :], axis=1)
    else:
        den = tl.zeros([RB], dtype=tl.float32)  # unused
    p_k = _p_whole(pk_ptr, h, D, M, dt, BD, BDT, BM)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    # a whole-chunk program (NB = 1) as straight-line code, blocks as a runtime loop: the fastest
    # form of each (docs/benchmarks.md)
    if NB == 1:
        num, den = _out_tile(num, den, qf, p_k, pk_ptr, h, k_base, v_base, t0, t_stop, skt, svt,
                             v_cols, D, M, DV, feat_mask, False, RB, BD, BDT, BM, NORM, PREC)
    else:
        for kb in range(0, own + 1):
            num, den = _out_tile(num, den, qf, p_k, pk_ptr, h, k_base, v_base, t0 + kb * RB,
                                 t_stop, skt, svt, v_cols, D, M, DV, feat_mask, kb < own, RB, BD,
                                 BDT, BM, NORM, PREC)
    if NORM == 0:
        # > 0 by construction; the clamp only turns an fp32 underflow 0/0 into 0
        den = tl.maximum(den, 1.1754943508222875e-38)
        num = num / den[:, None]
    elif NORM == 2:
        den = tl.load(seen_ptr + pid_bh) + (rows - seq_start + 1).to(tl.float32)
        num = num / den[:, None]
    else:
        den = tl.full([RB], 1.0, tl.float32)
    o_rows = _token_rows(b, rows, h, B, T, H, TMAJOR)
    tl.store(o_ptr + o_rows[:, None] * DV + v_cols[None, :], num.to(o_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (v_cols[None, :] < DV))
    if pid_v == 0:
        tl.store(den_ptr + pid_bh * T + rows, den, mask=row_mask)


# ------------------------------------------------------------------------------------------
# the state scans in two parallel steps (cfg scan="parallel"): per-chunk deltas, then a prefix sum
# ------------------------------------------------------------------------------------------
@triton.jit
def asa_chunk_delta_kernel(
    x_ptr, p_ptr, y_ptr, den_ptr, r_ptr, delta_ptr, dz_ptr, chunks_ptr,
    T, H, G, D, M, DV, NT,
    sxb, sxt, sxh, syb, syt, syh,
    BT: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
    BACKWARD: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
    o_ptr=None, R_FUSED: tl.constexpr = False,
):
    """grid (NT, cdiv(Dv, BV), B*H): one chunk's contribution to the state, all chunks at once.

    forward  (x = k of head h // G, y = v):  Δ = k'ᵀ v,  Δz = Σ_t k'_t;
    backward (x = q of head h, y = dO):      Δ = q'ᵀ g,  Δz = Σ_t r_t q'_t  (g = dO/den, linear r).
    delta: [B*H, NT, M, DV] fp32 (bf16 with cfg deltas_half); dz: [B*H, NT, M] fp32.
    R_FUSED (backward, linear, one Dv block: BV >= DV): r = −(dO·o)/den is computed here from
    o (dO's layout and strides) and stored to r ([B, H, T] fp32) for the gradient kernels, in
    place of ``asa_bwd_r_kernel``'s launch; else r is read from r_ptr."""
    c, pid_v, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // H, pid_bh % H
    hx = h // G
    dt = x_ptr.dtype.element_ty
    t0, t_stop, _seq_start = _chunk_span(chunks_ptr, c, T, BT, VARLEN)
    rows = t0 + tl.arange(0, BT)
    row_mask = rows < t_stop
    m_idx = tl.arange(0, BM)
    v_cols = pid_v * BV + tl.arange(0, BV)
    feat_mask = m_idx < M
    f = _features(x_ptr + b * sxb + hx * sxh, t0, t_stop, sxt,
                  _p_whole(p_ptr, h, D, M, dt, BD, BDT, BM), p_ptr, h, D, M, feat_mask, row_mask,
                  dt, BT, BD, BDT, BM, PREC)
    if BACKWARD:
        y = _load_rows(y_ptr + b * syb + h * syh, t0, t_stop, syt, v_cols, DV,
                       BT).to(tl.float32)
        if NORM != 1:
            den = tl.load(den_ptr + pid_bh * T + rows, mask=row_mask, other=1.0)
            if R_FUSED:
                o = _load_rows(o_ptr + b * syb + h * syh, t0, t_stop, syt, v_cols, DV,
                               BT).to(tl.float32)
                r_rows = -tl.sum(y * o, axis=1) / den
                tl.store(r_ptr + pid_bh * T + rows, r_rows, mask=row_mask)
            y = y / den[:, None]
        y = y.to(dt)
    else:
        y = _load_rows(y_ptr + b * syb + hx * syh, t0, t_stop, syt, v_cols, DV, BT).to(dt)
    delta = tl.dot(tl.trans(f.to(dt)), y, input_precision=PREC)
    out = pid_bh * NT + c
    tl.store(delta_ptr + out * M * DV + m_idx[:, None] * DV + v_cols[None, :],
             delta.to(delta_ptr.dtype.element_ty), mask=feat_mask[:, None] & (v_cols[None, :] < DV))
    if pid_v == 0:
        if BACKWARD:
            if NORM == 0:
                if R_FUSED:
                    r = r_rows
                else:
                    r = tl.load(r_ptr + pid_bh * T + rows, mask=row_mask, other=0.0)
                tl.store(dz_ptr + out * M + m_idx, tl.sum(f * r[:, None], axis=0),
                         mask=feat_mask)
        else:
            tl.store(dz_ptr + out * M + m_idx, tl.sum(f, axis=0), mask=feat_mask)


# ------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------
@triton.jit
def asa_bwd_states_kernel(
    q_ptr, pq_ptr, do_ptr, den_ptr, r_ptr, dstates_ptr, dzs_ptr, ds0_ptr, dz0_ptr, dsf_ptr,
    dzf_ptr,
    T, H, D, M, DV, NT,
    sqb, sqt, sqh,
    BT: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr,
    NORM: tl.constexpr, PREC: tl.constexpr, HAS_INIT: tl.constexpr = False,
    STORE_FINAL: tl.constexpr = False, B=1, TMAJOR: tl.constexpr = False,
):
    """grid (cdiv(Dv, BV), B*H): dS_c = Σ_{chunks > c} q'ᵀ g and dz_c = Σ_{chunks > c} q'ᵀ r.
    dO: [B, T, H, DV] (memory as ``_token_rows``); den, r: [B, H, T] fp32.
    HAS_INIT: the sums start at the final state's gradient (ds0, dz0: [B*H, M, DV] / [B*H, M]
    fp32), and dz_c is stored whatever NORM (the final z's gradient reaches every chunk's k');
    STORE_FINAL: the sums past the first chunk, the initial state's gradient, go to dsf, dzf."""
    pid_v, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    dt = q_ptr.dtype.element_ty
    m_idx = tl.arange(0, BM)
    v_cols = pid_v * BV + tl.arange(0, BV)
    feat_mask = m_idx < M
    p = _p_whole(pq_ptr, h, D, M, dt, BD, BDT, BM)
    sv_mask = feat_mask[:, None] & (v_cols[None, :] < DV)
    s_off = m_idx[:, None] * DV + v_cols[None, :]
    dS = tl.zeros([BM, BV], dtype=tl.float32)
    dz = tl.zeros([BM], dtype=tl.float32)
    if HAS_INIT:
        dS = tl.load(ds0_ptr + pid_bh * M * DV + s_off, mask=sv_mask, other=0.0)
        dz = tl.load(dz0_ptr + pid_bh * M + m_idx, mask=feat_mask, other=0.0)
    q_base = q_ptr + b * sqb + h * sqh
    for i in range(NT):
        c = NT - 1 - i
        out = pid_bh * NT + c
        tl.store(dstates_ptr + out * M * DV + s_off, dS, mask=sv_mask)
        if NORM == 0 or HAS_INIT:
            if pid_v == 0:
                tl.store(dzs_ptr + out * M + m_idx, dz, mask=feat_mask)
        t0 = c * BT
        rows = t0 + tl.arange(0, BT)
        row_mask = rows < T
        qf = _features(q_base, t0, T, sqt, p, pq_ptr, h, D, M, feat_mask, row_mask, dt, BT, BD,
                       BDT, BM, PREC)
        o_rows = _token_rows(b, rows, h, B, T, H, TMAJOR)
        g = tl.load(do_ptr + o_rows[:, None] * DV + v_cols[None, :],
                    mask=row_mask[:, None] & (v_cols[None, :] < DV), other=0.0).to(tl.float32)
        if NORM != 1:
            den = tl.load(den_ptr + pid_bh * T + rows, mask=row_mask, other=1.0)
            g = g / den[:, None]
        dS += tl.dot(tl.trans(qf.to(dt)), g.to(dt), input_precision=PREC)
        if NORM == 0:
            r = tl.load(r_ptr + pid_bh * T + rows, mask=row_mask, other=0.0)
            dz += tl.sum(qf * r[:, None], axis=0)
    if STORE_FINAL:
        tl.store(dsf_ptr + pid_bh * M * DV + s_off, dS, mask=sv_mask)
        if pid_v == 0:
            tl.store(dzf_ptr + pid_bh * M + m_idx, dz, mask=feat_mask)


@triton.jit
def asa_bwd_r_kernel(do_ptr, o_ptr, den_ptr, r_ptr, T, H, DV,
                     BT: tl.constexpr, BV: tl.constexpr, B=1, TMAJOR: tl.constexpr = False):
    """grid (cdiv(T, BT), B*H): the linear normalisation's r = −(dO·o)/den per token.
    dO, o: [B, T, H, DV] in one layout (``_token_rows``; read once, in their own dtype); den, r:
    [B, H, T] fp32."""
    pid_t, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_t * BT + tl.arange(0, BT)
    cols = tl.arange(0, BV)
    row_mask = rows < T
    at = _token_rows(b, rows, h, B, T, H, TMAJOR)[:, None] * DV + cols[None, :]
    mask = row_mask[:, None] & (cols[None, :] < DV)
    g = tl.load(do_ptr + at, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + at, mask=mask, other=0.0).to(tl.float32)
    den = tl.load(den_ptr + pid_bh * T + rows, mask=row_mask, other=1.0)
    tl.store(r_ptr + pid_bh * T + rows, -tl.sum(g * o, axis=1) / den, mask=row_mask)


@triton.jit
def _feature_grad_store(dfeat, x_base, x_stride, p_ptr, h, t0, t_stop, o_rows, l_rows, dl_ptr,
                        dx_ptr, D, M, feat_mask, row_mask, BT: tl.constexpr, BD: tl.constexpr,
                        BDT: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr):
    """The softmax backward of one side and its stores: dℓ = f ⊙ (df − Σ_m f ⊙ df) with the fp32
    features (recomputed here rather than kept live through the gradient loops), then
    dx = dℓ Pᵀ, computed and stored per D tile of BDT columns (one tile when BDT = BD)."""
    dt = x_base.dtype.element_ty
    m_idx = tl.arange(0, BM)
    p = _p_whole(p_ptr, h, D, M, dt, BD, BDT, BM)
    f32 = _features(x_base, t0, t_stop, x_stride, p, p_ptr, h, D, M, feat_mask, row_mask, dt, BT,
                    BD, BDT, BM, PREC)
    dl = f32 * (dfeat - tl.sum(f32 * dfeat, axis=1)[:, None])
    tl.store(dl_ptr + l_rows[:, None] * M + m_idx[None, :], dl.to(dl_ptr.dtype.element_ty),
             mask=row_mask[:, None] & feat_mask[None, :])
    dl = dl.to(dt)
    if BDT == BD:
        d_cols = tl.arange(0, BD)
        dx = tl.dot(dl, tl.trans(p), input_precision=PREC)
        tl.store(dx_ptr + o_rows[:, None] * D + d_cols[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None] & (d_cols[None, :] < D))
    else:
        for d0 in range(0, BD, BDT):
            d_cols = d0 + tl.arange(0, BDT)
            p_t = _load_p_rows(p_ptr, h, d_cols, D, M, BM).to(dt)
            dx = tl.dot(dl, tl.trans(p_t), input_precision=PREC)
            tl.store(dx_ptr + o_rows[:, None] * D + d_cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (d_cols[None, :] < D))


@triton.jit
def _scaled_grad(do_ptr, o_rows, row_mask, den, v_cols, DV, like_ptr, NORM: tl.constexpr):
    """g = dO / den of a block of rows (dO itself without a denominator), as a matmul operand
    in ``like_ptr``'s dtype."""
    g = tl.load(do_ptr + o_rows[:, None] * DV + v_cols[None, :],
                mask=row_mask[:, None] & (v_cols[None, :] < DV), other=0.0).to(tl.float32)
    if NORM != 1:
        g = g / den[:, None]
    return g.to(like_ptr.dtype.element_ty)


@triton.jit
def asa_bwd_block_kernel(
    q_ptr, k_ptr, v_ptr, pq_ptr, pk_ptr, do_ptr, den_ptr, r_ptr,
    states_ptr, zs_ptr, dstates_ptr, dzs_ptr,
    dx_ptr, dv_ptr, dl_ptr, chunks_ptr,
    T, H, G, D, M, DV, NT,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
    BT: tl.constexpr, RB: tl.constexpr, BD: tl.constexpr, BDT: tl.constexpr, BM: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr, SIDE: tl.constexpr,
    VARLEN: tl.constexpr, DZ: tl.constexpr = False, B=1, TMAJOR: tl.constexpr = False,
):
    """grid (NT · BT/RB, B*H): the gradients of one block of RB rows of a chunk (cfg bwd_rows),
    in two launches (fewer live registers each). The block meets the rest of its chunk in
    RB × RB tiles, as flash attention's backward meets keys: the earlier blocks (query side) or
    the later ones (key side) as full tiles, its own block as the causal diagonal tile; the
    chunk states stay per BT-token chunk.

    * ``SIDE == 0`` (rows = queries i): dq' = Σ_{key blocks ≤ own} tril(g vᵀ + r 1ᵀ) k'
      + g Sᵀ + r zᵀ  ->  dℓ_q -> dq ``[B, T, H, D]``;
    * ``SIDE == 1`` (rows = keys j): dk' = Σ_{query blocks ≥ own} tril(g vᵀ + r 1ᵀ)ᵀ q'
      + v dSᵀ + dz and dv = Σ tril(q' k'ᵀ)ᵀ g + k' dS  ->  dℓ_k -> dk, dv per *query* head
      ``[B, T, H, D(v)]`` (the caller sums GQA groups). The key side adds dz_c when NORM is
      linear or ``DZ`` (the final state's z has a gradient, which reaches every k').

    dO, dx and dv are laid out as o (``_token_rows``: TMAJOR, the memory of Megatron's
    ``[s, b, h, d]``); dℓ (``dl``, ``[B, T, H, M]``) is kept for dP. Dv runs in NV blocks of BV
    columns; with NV = 1 the key side reads each query block once for both dA and dv, otherwise
    dv takes a pass of its own per Dv block.

    Why blocks of a chunk: a whole 128-token chunk per program holds [128, ·] fp32 accumulators
    that spill registers (``tools/kernel_spills.py``); 64-row blocks at 4 warps spill far less
    and run faster (docs/benchmarks.md)."""
    pid, pid_bh = tl.program_id(0), tl.program_id(1)
    NB: tl.constexpr = BT // RB
    c, own = pid // NB, pid % NB
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    dt = q_ptr.dtype.element_ty
    t0, t_stop, _seq_start = _chunk_span(chunks_ptr, c, T, BT, VARLEN)
    r0 = t0 + own * RB
    rows = r0 + tl.arange(0, RB)
    row_mask = rows < t_stop
    m_idx = tl.arange(0, BM)
    feat_mask = m_idx < M
    q_base = q_ptr + b * sqb + h * sqh
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    o_rows = _token_rows(b, rows, h, B, T, H, TMAJOR)  # dO, dx, dv
    st = pid_bh * NT + c
    ones = tl.full([RB], 1.0, tl.float32)
    # the diagonal tile's causal mask, in tile coordinates (row, column)
    if SIDE == 0:
        diag = tl.arange(0, RB)[:, None] >= tl.arange(0, RB)[None, :]  # query i ≥ key j
    else:
        diag = tl.arange(0, RB)[None, :] >= tl.arange(0, RB)[:, None]  # rows are keys j
    if SIDE == 0:
        den = ones
        if NORM != 1:
            den = tl.load(den_ptr + pid_bh * T + rows, mask=row_mask, other=1.0)
        dfeat = tl.zeros([RB, BM], dtype=tl.float32)
        if NORM == 0:
            r = tl.load(r_ptr + pid_bh * T + rows, mask=row_mask, other=0.0)
            z = tl.load(zs_ptr + st * M + m_idx, mask=feat_mask, other=0.0)
            dfeat += r[:, None] * z[None, :]
        for vb in tl.static_range(NV):
            v_cols = vb * BV + tl.arange(0, BV)
            S = tl.load(states_ptr + st * M * DV + m_idx[:, None] * DV + v_cols[None, :],
                        mask=feat_mask[:, None] & (v_cols[None, :] < DV), other=0.0).to(dt)
            g = _scaled_grad(do_ptr, o_rows, row_mask, den, v_cols, DV, q_ptr, NORM)
            dfeat += tl.dot(g, tl.trans(S), input_precision=PREC)
        p_k = _p_whole(pk_ptr, h, D, M, dt, BD, BDT, BM)
        for kb in range(0, own + 1):
            k0 = t0 + kb * RB
            key_mask = (k0 + tl.arange(0, RB)) < t_stop
            dA = tl.zeros([RB, RB], dtype=tl.float32)
            if NORM == 0:
                dA += r[:, None]
            for vb in tl.static_range(NV):
                v_cols = vb * BV + tl.arange(0, BV)
                if NV > 1:  # else g is still the one block's, from the states' term
                    g = _scaled_grad(do_ptr, o_rows, row_mask, den, v_cols, DV, q_ptr, NORM)
                vc = _load_rows(v_base, k0, t_stop, svt, v_cols, DV, RB).to(dt)
                dA += tl.dot(g, tl.trans(vc), input_precision=PREC)
            dA = tl.where(diag | (kb < own), dA, 0.0).to(dt)
            kf = _features(k_base, k0, t_stop, skt, p_k, pk_ptr, h, D, M, feat_mask, key_mask, dt,
                           RB, BD, BDT, BM, PREC).to(dt)
            dfeat += tl.dot(dA, kf, input_precision=PREC)
        x_base, x_stride, p_ptr = q_base, sqt, pq_ptr
    else:
        p_q = _p_whole(pq_ptr, h, D, M, dt, BD, BDT, BM)
        kf = _features(k_base, r0, t_stop, skt, _p_whole(pk_ptr, h, D, M, dt, BD, BDT, BM), pk_ptr,
                       h, D, M, feat_mask, row_mask, dt, RB, BD, BDT, BM, PREC).to(dt)
        dfeat = tl.zeros([RB, BM], dtype=tl.float32)
        if NORM == 0 or DZ:
            dz = tl.load(dzs_ptr + st * M + m_idx, mask=feat_mask, other=0.0)
            dfeat += dz[None, :]
        # the chunk's later states: dk' += v dSᵀ, dv = k' dS (+ the tiles below)
        for vb in tl.static_range(NV):
            v_cols = vb * BV + tl.arange(0, BV)
            dS = tl.load(dstates_ptr + st * M * DV + m_idx[:, None] * DV + v_cols[None, :],
                         mask=feat_mask[:, None] & (v_cols[None, :] < DV), other=0.0).to(dt)
            vc = _load_rows(v_base, r0, t_stop, svt, v_cols, DV, RB).to(dt)
            dfeat += tl.dot(vc, tl.trans(dS), input_precision=PREC)
            if NV > 1:  # dv of this Dv block in its own pass over the query blocks
                dv = tl.dot(kf, dS, input_precision=PREC)
                for qb in range(own, NB):
                    i0 = t0 + qb * RB
                    q_mask = (i0 + tl.arange(0, RB)) < t_stop
                    qf = _features(q_base, i0, t_stop, sqt, p_q, pq_ptr, h, D, M, feat_mask,
                                   q_mask, dt, RB, BD, BDT, BM, PREC).to(dt)
                    A_t = tl.where(diag | (qb > own),
                                   tl.dot(kf, tl.trans(qf), input_precision=PREC), 0.0).to(dt)
                    den_q = ones
                    if NORM != 1:
                        den_q = tl.load(den_ptr + pid_bh * T + i0 + tl.arange(0, RB),
                                        mask=q_mask, other=1.0)
                    g = _scaled_grad(do_ptr,
                                     _token_rows(b, i0 + tl.arange(0, RB), h, B, T, H, TMAJOR),
                                     q_mask, den_q, v_cols, DV, q_ptr, NORM)
                    dv += tl.dot(A_t, g, input_precision=PREC)
                tl.store(dv_ptr + o_rows[:, None] * DV + v_cols[None, :],
                         dv.to(dv_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & (v_cols[None, :] < DV))
            else:
                dv = tl.dot(kf, dS, input_precision=PREC)
        for qb in range(own, NB):
            i0 = t0 + qb * RB
            q_rows = i0 + tl.arange(0, RB)
            q_mask = q_rows < t_stop
            qf = _features(q_base, i0, t_stop, sqt, p_q, pq_ptr, h, D, M, feat_mask, q_mask, dt,
                           RB, BD, BDT, BM, PREC).to(dt)
            den_q = ones
            if NORM != 1:
                den_q = tl.load(den_ptr + pid_bh * T + q_rows, mask=q_mask, other=1.0)
            dA_t = tl.zeros([RB, RB], dtype=tl.float32)  # transposed: rows keys, columns queries
            if NORM == 0:
                dA_t += tl.load(r_ptr + pid_bh * T + q_rows, mask=q_mask, other=0.0)[None, :]
            for vb in tl.static_range(NV):
                v_cols = vb * BV + tl.arange(0, BV)
                g = _scaled_grad(do_ptr, _token_rows(b, q_rows, h, B, T, H, TMAJOR), q_mask, den_q,
                                 v_cols, DV, q_ptr, NORM)
                if NV > 1:  # else vc is still the one block's, from the states' term
                    vc = _load_rows(v_base, r0, t_stop, svt, v_cols, DV, RB).to(dt)
                dA_t += tl.dot(vc, tl.trans(g), input_precision=PREC)
                if NV == 1:
                    A_t = tl.where(diag | (qb > own),
                                   tl.dot(kf, tl.trans(qf), input_precision=PREC), 0.0).to(dt)
                    dv += tl.dot(A_t, g, input_precision=PREC)
            dA_t = tl.where(diag | (qb > own), dA_t, 0.0).to(dt)
            dfeat += tl.dot(dA_t, qf, input_precision=PREC)
        if NV == 1:
            v_cols = tl.arange(0, BV)
            tl.store(dv_ptr + o_rows[:, None] * DV + v_cols[None, :],
                     dv.to(dv_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & (v_cols[None, :] < DV))
        x_base, x_stride, p_ptr = k_base, skt, pk_ptr
    _feature_grad_store(dfeat, x_base, x_stride, p_ptr, h, r0, t_stop, o_rows,
                        (b * T + rows) * H + h, dl_ptr, dx_ptr, D, M, feat_mask, row_mask, RB, BD,
                        BDT, BM, PREC)


@triton.jit
def asa_bwd_dp_kernel(
    q_ptr, k_ptr, dlq_ptr, dlk_ptr, dp_part_ptr,
    T, H, G, D, M, NT, CPG,
    sqb, sqt, sqh, skb, skt, skh,
    BDT: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
):
    """grid (NG = cdiv(NT, CPG), cdiv(D, BDT), 2*B*H): partial dP[h] = Σ xᵀ dℓ over CPG chunks
    of one (batch, head), rows d0..d0+BDT of it (the D tile: a ``[BDT, BM]`` accumulator, so
    that d_h = 512 fits; one tile when BDT covers the padded D). Both sides in one launch: the
    first B*H programs of the last axis take the query side (x = q of head h, dℓ_q), the others
    the key side (x = k of head h // G, dℓ_k).

    q, k: [B, T, H_x, D]; dℓ_q, dℓ_k: [B, T, H, M] contiguous (fp32 or the inputs' half dtype);
    dp_part: [2, NG, B*H, D, M] fp32, summed over NG and B by ``asa_dp_reduce_kernel``
    (deterministic, no atomics)."""
    grp, pid_d, pid_z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    BH = tl.num_programs(2) // 2
    side = pid_z // BH
    pid_bh = pid_z - side * BH
    b, h = pid_bh // H, pid_bh % H
    if side == 0:
        x_base = q_ptr + b * sqb + h * sqh
        dl_ptr = dlq_ptr
        sxt = sqt
    else:
        x_base = k_ptr + b * skb + (h // G) * skh
        dl_ptr = dlk_ptr
        sxt = skt
    d_cols = pid_d * BDT + tl.arange(0, BDT)
    m_idx = tl.arange(0, BM)
    acc = tl.zeros([BDT, BM], dtype=tl.float32)
    for i in range(0, CPG):
        t0 = (grp * CPG + i) * BT
        rows = t0 + tl.arange(0, BT)
        row_mask = rows < T
        # x in dℓ's dtype: fp32 (tf32 products), or the inputs' half dtype (cfg dl_half)
        xc = _load_rows(x_base, t0, T, sxt, d_cols, D, BT).to(dl_ptr.dtype.element_ty)
        o_rows = (b * T + rows) * H + h
        dl = tl.load(dl_ptr + o_rows[:, None] * M + m_idx[None, :],
                     mask=row_mask[:, None] & (m_idx[None, :] < M), other=0.0)
        acc += tl.dot(tl.trans(xc), dl, input_precision=PREC)
    out = ((side * tl.num_programs(0) + grp) * BH + pid_bh) * D * M
    tl.store(dp_part_ptr + out + d_cols[:, None] * M + m_idx[None, :], acc,
             mask=(d_cols[:, None] < D) & (m_idx[None, :] < M))


@triton.jit
def asa_dp_reduce_kernel(part_ptr, dp_ptr, R, N, BLOCK: tl.constexpr):
    """grid (cdiv(N, BLOCK), 2): dp[s, j] = Σ_{r < R} part[s, r, j] in fp32, in order of r,
    stored in dp's dtype (the parameters'): ``asa_bwd_dp_kernel``'s partials [2, R = NG·B,
    N = H·D·M] reduced and cast in one launch (a torch sum and cast were two ops)."""
    pid, s = tl.program_id(0), tl.program_id(1)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = part_ptr + s * R * N
    for r in range(0, R):
        acc += tl.load(base + r * N + cols, mask=mask, other=0.0)
    tl.store(dp_ptr + s * N + cols, acc.to(dp_ptr.dtype.element_ty), mask=mask)
