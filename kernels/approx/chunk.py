"""Triton kernels of approx: the deconstructing-attention paper's three-term linear attention.

Per (batch, query head), q and k pre-scaled by ``σ = D^{-1/4}``; two feature maps of the scaled
vectors, ``f1(x) = x`` and ``f2(x) = x ⊙ x / √2`` (element-wise: D features each, so both states
are D × D — the element-wise square ``Σ_d q_d² k_d²`` is not the Based-style ``(q·k)²`` with D²
features). With a = f(q~), b = f(k~), chunks of ``BT`` tokens and the states entering chunk c
``S = Σ_{j<c} bᵀ v`` (D × D), ``z = Σ_{j<c} b``, ``sv = Σ_{j<c} v``::

    forward   states:  S1, S2, z1, z2, sv before every chunk (and the final ones)
              output (parallel):  A_t = tril(a_t b_tᵀ),  den_t = A_t 1 + a_t·z_t,  d_t = safe(den_t)
                                  o_t = (A_t v + a_t S_t) / d_t   (t = 1, 2),
                                  o0  = (sv + tril(1) v) / n_i   (n_i = tokens so far, this one included)
                                  o   = o0 + o1 + o2
    backward  r_t = dden_t = −[|den_t| ≥ eps] (dO·o_t) / d_t  (safe() is constant where it guards),
              reverse states: dS_t = Σ_{i>c} (a_t/d_t)ᵀ dO,  dz_t = Σ_{i>c} r_t a_t,
                              dsv = Σ_{i>c} dO / n          (summed over the GQA group)
              per chunk: E_t = tril(dO vᵀ / d_t + r_t 1ᵀ)
                         da_t = E_t b_t + (dO/d_t) S_tᵀ + r_t z_tᵀ,   db_t = E_tᵀ a_t + v dS_tᵀ + dz_t
                         dv   = tril(A1/d1 + A2/d2 + 1/n)ᵀ dO + b1 dS1 + b2 dS2 + dsv
                         dq = σ (da1 + √2 q~ ⊙ da2),  dk = σ (db1 + √2 k~ ⊙ db2)
              states: the final state is the initial one plus every chunk's sums, so the reverse
                      sums start at the final state's gradient (instead of 0) and their total
                      after chunk 0 is the initial state's gradient (both fp32; only when given
                      or asked for: ``function.py``)

The state scans (forward states and backward reverse states) run one of two ways, chosen by the
launch option ``scan`` (``function.py: launch_config``):

* ``"parallel"`` (default): a delta kernel, parallel over every chunk
  (``approx_fwd_delta_kernel``, ``approx_bwd_delta_kernel``; grid (D/BK · D/BV, NT, B·H_kv),
  [BK, BV] blocks of S), writes each chunk's own contribution — ΔS_t = b_tᵀ v (forward) or
  Σ_group (a_t/d_t)ᵀ dO (backward), tensor-core dots, and the vector ones Σ b_t, Σ v (forward)
  or Σ r_t a_t, Σ dO/n (backward) — then an exclusive prefix sum over chunks (forward; reverse
  in the backward) carrying only a running fp32 sum: ``chunk_scan_pair_kernel`` (kernels/scan.py,
  shared with ASA), S and the vectors in one launch, with the initial state as its start
  and the final state as its last sum.
* ``"sequential"``: one program per ``BK × BV`` block of S and (batch, KV head) walks every chunk
  in order with a matmul per chunk (``approx_fwd_states_kernel``, ``approx_bwd_states_kernel``):
  fewer bytes, but its latency grows with T/BT.

Both write the same tensors, which the output and gradient kernels read: S1 and S2 of every
chunk as one ``[B, H_kv, NT, 2, D, D]`` tensor in the matmul operand dtype (the input's for
bf16/fp16 — they are rounded to it for the tensor cores anyway — fp32 for fp32 inputs), and z1,
z2, sv as one fp32 ``[B, H_kv, NT, 3, D]`` tensor (the backward's dS and dz, dsv alike); the
initial and final states ``[B, H_kv, 2, D, D]`` and ``[B, H_kv, 3, D]``, fp32. Every sum and
accumulation is fp32; the parallel path's per-chunk deltas are bf16 for bf16 inputs (launch
option ``deltas_half``), else fp32. The backward reads the forward's states (launch option
``keep_states``) or recomputes them. Triton's interpreter mis-computes bf16 dots, so there
(only) bf16 operands go through fp32 (``DOT_F32``).

``safe`` replaces ``|den| < eps`` by ``±eps`` (sign kept, +eps for 0), exactly as
``megatron_subq.ops.approx.safe_denominator``.

Layout: q ``[B, T, H, D]``, k, v ``[B, T, H_kv, D]`` contiguous; D padded to a power of two ≥ 16
with masked loads (padded features and padded tokens are 0 and add nothing).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import operand as _operand, tile as _tile

INV_SQRT2 = tl.constexpr(0.7071067811865476)  # jit globals must be constexpr
SQRT2 = tl.constexpr(1.4142135623730951)


@triton.jit
def _square(x):
    """The second-order feature map: x ⊙ x / √2."""
    return x * x * INV_SQRT2


@triton.jit
def _safe(den, eps):
    """den with |den| < eps replaced by ±eps (sign kept, +eps for 0)."""
    guard = tl.where(den < 0, -eps, eps)
    return tl.where(tl.abs(den) < eps, guard, den)


@triton.jit
def _load_states(s_ptr, zv_ptr, row, d_cols, v_cols, D, BK: tl.constexpr, BV: tl.constexpr,
                 LOAD: tl.constexpr):
    """(S1, S2, z1, z2, sv) blocks of row ``row`` of ``[rows, 2, D, D]`` / ``[rows, 3, D]``
    fp32 (the layouts ``_store_states`` writes), or zeros without ``LOAD``."""
    d_ok, v_ok = d_cols < D, v_cols < D
    if LOAD:
        s_off = row * 2 * D * D + d_cols[:, None] * D + v_cols[None, :]
        s_mask = d_ok[:, None] & v_ok[None, :]
        zv = zv_ptr + row * 3 * D
        S1 = tl.load(s_ptr + s_off, mask=s_mask, other=0.0)
        S2 = tl.load(s_ptr + s_off + D * D, mask=s_mask, other=0.0)
        z1 = tl.load(zv + d_cols, mask=d_ok, other=0.0)
        z2 = tl.load(zv + D + d_cols, mask=d_ok, other=0.0)
        sv = tl.load(zv + 2 * D + v_cols, mask=v_ok, other=0.0)
    else:
        S1 = tl.zeros([BK, BV], dtype=tl.float32)
        S2 = tl.zeros([BK, BV], dtype=tl.float32)
        z1 = tl.zeros([BK], dtype=tl.float32)
        z2 = tl.zeros([BK], dtype=tl.float32)
        sv = tl.zeros([BV], dtype=tl.float32)
    return S1, S2, z1, z2, sv


# ------------------------------------------------------------------------------------------
# forward
# ------------------------------------------------------------------------------------------
@triton.jit
def _store_states(ds_ptr, dzv_ptr, out, pid_k, pid_v, d_cols, v_cols, D, d1, d2, z1, z2, sv):
    """Every state store (deltas, states, reverse states, initial/final ones): the [BK, BV]
    blocks of S1, S2 at row ``out`` of ``[rows, 2, D, D]`` (a chunk row of ``[B*H_kv, NT, ...]``
    or a ``[B*H_kv, ...]`` state row; cast to the buffer's dtype) and the vectors (z1, z2 from
    the programs of the first Dv block, sv from those of the first D block) into
    ``[rows, 3, D]``."""
    d_ok, v_ok = d_cols < D, v_cols < D
    s_off = out * 2 * D * D + d_cols[:, None] * D + v_cols[None, :]
    s_mask = d_ok[:, None] & v_ok[None, :]
    tl.store(ds_ptr + s_off, d1.to(ds_ptr.dtype.element_ty), mask=s_mask)
    tl.store(ds_ptr + s_off + D * D, d2.to(ds_ptr.dtype.element_ty), mask=s_mask)
    zv = dzv_ptr + out * 3 * D
    if pid_v == 0:
        tl.store(zv + d_cols, z1, mask=d_ok)
        tl.store(zv + D + d_cols, z2, mask=d_ok)
    if pid_k == 0:
        tl.store(zv + 2 * D + v_cols, sv, mask=v_ok)


@triton.jit
def approx_fwd_delta_kernel(
    k_ptr, v_ptr, ds_ptr, dzv_ptr,
    T, HKV, D, NT, NV, scale,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """grid (cdiv(D, BK)·NV, NT, B*H_kv), NV = cdiv(D, BV) (cfg scan="parallel"): chunk c's own
    contribution to the forward states, every chunk at once: the [BK, BV] blocks of
    ΔS1 = b1ᵀ v and ΔS2 = b2ᵀ v, Δz1 = Σ b1, Δz2 = Σ b2 (its BK features, from pid_v = 0) and
    Δsv = Σ v (its BV columns, from pid_k = 0).

    ds_ptr: [B, H_kv, NT, 2, D, D] (fp32, or bf16 with cfg deltas_half); dzv_ptr:
    [B, H_kv, NT, 3, D] fp32 — the layouts of the states the prefix sum turns them into."""
    pid_kv, c, pid_bk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_k, pid_v = pid_kv // NV, pid_kv % NV
    b, hk = pid_bk // HKV, pid_bk % HKV
    t0 = c * BT
    d_cols = pid_k * BK + tl.arange(0, BK)
    v_cols = pid_v * BV + tl.arange(0, BV)
    base = (b * T * HKV + hk) * D
    b1 = _tile(k_ptr + base, t0, T, HKV * D, d_cols, D, BT) * scale  # padded tokens: 0
    b2 = _square(b1)
    v = _tile(v_ptr + base, t0, T, HKV * D, v_cols, D, BT)
    vo = _operand(v, k_ptr, DOT_F32)
    d1 = tl.dot(tl.trans(_operand(b1, k_ptr, DOT_F32)), vo, input_precision=PREC)
    d2 = tl.dot(tl.trans(_operand(b2, k_ptr, DOT_F32)), vo, input_precision=PREC)
    _store_states(ds_ptr, dzv_ptr, pid_bk * NT + c, pid_k, pid_v, d_cols, v_cols, D, d1, d2,
                       tl.sum(b1, axis=0), tl.sum(b2, axis=0), tl.sum(v, axis=0))


@triton.jit
def approx_fwd_states_kernel(
    k_ptr, v_ptr, s0_ptr, zv0_ptr, s_ptr, zv_ptr, sf_ptr, zvf_ptr,
    T, HKV, D, NT, scale,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr,
    STORE_FINAL: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """grid (cdiv(D, BK), cdiv(D, BV), B*H_kv) (cfg scan="sequential"): the [BK, BV] blocks of
    S1, S2 entering every chunk (z1, z2 from the programs with pid_v = 0, sv from those with
    pid_k = 0), and the final ones, in one walk over the chunks.

    s_ptr: [B, H_kv, NT, 2, D, D] (S1, S2); zv_ptr: [B, H_kv, NT, 3, D] (z1, z2, sv, fp32);
    the initial (s0, zv0) and final (sf, zvf) states: [B, H_kv, 2, D, D], [B, H_kv, 3, D] fp32."""
    pid_k, pid_v, pid_bk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hk = pid_bk // HKV, pid_bk % HKV
    k_cols = pid_k * BK + tl.arange(0, BK)
    v_cols = pid_v * BV + tl.arange(0, BV)
    S1, S2, z1, z2, sv = _load_states(s0_ptr, zv0_ptr, pid_bk, k_cols, v_cols, D, BK, BV,
                                      HAS_STATE)
    base = (b * T * HKV + hk) * D
    for c in range(NT):
        _store_states(s_ptr, zv_ptr, pid_bk * NT + c, pid_k, pid_v, k_cols, v_cols, D, S1, S2,
                      z1, z2, sv)
        t0 = c * BT
        b1 = _tile(k_ptr + base, t0, T, HKV * D, k_cols, D, BT) * scale
        b2 = _square(b1)
        v = _tile(v_ptr + base, t0, T, HKV * D, v_cols, D, BT)
        vo = _operand(v, k_ptr, DOT_F32)
        S1 += tl.dot(tl.trans(_operand(b1, k_ptr, DOT_F32)), vo, input_precision=PREC)
        S2 += tl.dot(tl.trans(_operand(b2, k_ptr, DOT_F32)), vo, input_precision=PREC)
        z1 += tl.sum(b1, axis=0)
        z2 += tl.sum(b2, axis=0)
        sv += tl.sum(v, axis=0)
    if STORE_FINAL:
        _store_states(sf_ptr, zvf_ptr, pid_bk, pid_k, pid_v, k_cols, v_cols, D, S1, S2, z1, z2, sv)


@triton.jit
def approx_fwd_out_kernel(
    q_ptr, k_ptr, v_ptr, s_ptr, zv_ptr,
    o_ptr, o1_ptr, o2_ptr, den_ptr,
    T, H, HKV, G, D, NT, L0, scale, eps,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """grid (cdiv(D, BV), NT, B*H): o, o1, o2 of chunk c for a block of BV value columns, and the
    raw denominators den1, den2 ([B, H, 2, T] fp32; V-block 0). s_ptr, zv_ptr: the chunk states
    ([B, H_kv, NT, 2, D, D], [B, H_kv, NT, 3, D])."""
    pid_v, c, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    v_cols = pid_v * BV + tl.arange(0, BV)
    kv_base = (b * T * HKV + hk) * D
    a1 = _tile(q_ptr + (b * T * H + h) * D, t0, T, H * D, d_cols, D, BT) * scale
    b1 = _tile(k_ptr + kv_base, t0, T, HKV * D, d_cols, D, BT) * scale
    a2, b2 = _square(a1), _square(b1)
    causal = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]  # [i, j]: j <= i
    A1 = tl.dot(_operand(a1, q_ptr, DOT_F32), tl.trans(_operand(b1, q_ptr, DOT_F32)),
                input_precision=PREC)
    A2 = tl.dot(_operand(a2, q_ptr, DOT_F32), tl.trans(_operand(b2, q_ptr, DOT_F32)),
                input_precision=PREC)
    A1 = tl.where(causal, A1, 0.0)
    A2 = tl.where(causal, A2, 0.0)
    sc = (b * HKV + hk) * NT + c  # the states' (b, kv head, chunk)
    zv_base = zv_ptr + sc * 3 * D
    z1 = tl.load(zv_base + d_cols, mask=d_cols < D, other=0.0)
    z2 = tl.load(zv_base + D + d_cols, mask=d_cols < D, other=0.0)
    den1 = tl.sum(A1, axis=1) + tl.sum(a1 * z1[None, :], axis=1)
    den2 = tl.sum(A2, axis=1) + tl.sum(a2 * z2[None, :], axis=1)
    if pid_v == 0:
        tl.store(den_ptr + pid_bh * 2 * T + rows, den1, mask=row_ok)
        tl.store(den_ptr + pid_bh * 2 * T + T + rows, den2, mask=row_ok)
    v = _tile(v_ptr + kv_base, t0, T, HKV * D, v_cols, D, BT)
    vo = _operand(v, q_ptr, DOT_F32)
    s_off = sc * 2 * D * D + d_cols[:, None] * D + v_cols[None, :]
    s_mask = (d_cols[:, None] < D) & (v_cols[None, :] < D)
    S1 = tl.load(s_ptr + s_off, mask=s_mask, other=0.0)
    S2 = tl.load(s_ptr + s_off + D * D, mask=s_mask, other=0.0)
    o1 = tl.dot(_operand(A1, q_ptr, DOT_F32), vo, input_precision=PREC)
    o1 = tl.dot(_operand(a1, q_ptr, DOT_F32), _operand(S1, q_ptr, DOT_F32), acc=o1,
                input_precision=PREC)
    o1 = o1 / _safe(den1, eps)[:, None]
    o2 = tl.dot(_operand(A2, q_ptr, DOT_F32), vo, input_precision=PREC)
    o2 = tl.dot(_operand(a2, q_ptr, DOT_F32), _operand(S2, q_ptr, DOT_F32), acc=o2,
                input_precision=PREC)
    o2 = o2 / _safe(den2, eps)[:, None]
    sv = tl.load(zv_base + 2 * D + v_cols, mask=v_cols < D, other=0.0)
    ones = tl.where(causal, 1.0, 0.0)
    count = (L0 + rows + 1).to(tl.float32)
    o0 = (tl.dot(_operand(ones, q_ptr, DOT_F32), vo, input_precision=PREC) + sv[None, :])
    o0 = o0 / count[:, None]
    offs = ((b * T + rows[:, None]) * H + h) * D + v_cols[None, :]
    mask = row_ok[:, None] & (v_cols[None, :] < D)
    tl.store(o_ptr + offs, (o0 + o1 + o2).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o1_ptr + offs, o1.to(o1_ptr.dtype.element_ty), mask=mask)
    tl.store(o2_ptr + offs, o2.to(o2_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------
@triton.jit
def approx_bwd_prep_kernel(
    do_ptr, o1_ptr, o2_ptr, den_ptr, r_ptr,
    T, H, D, eps,
    BT: tl.constexpr, BD: tl.constexpr,
):
    """grid (NT, B*H): r_t = −[|den_t| ≥ eps] (dO·o_t) / safe(den_t), t = 1, 2 ([B, H, 2, T])."""
    c, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    t0 = c * BT
    d_cols = tl.arange(0, BD)
    base = (b * T * H + h) * D
    do = _tile(do_ptr + base, t0, T, H * D, d_cols, D, BT)
    _store_r(do, o1_ptr + base, den_ptr + pid_bh * 2 * T, r_ptr + pid_bh * 2 * T, t0, T, H, D,
             eps, d_cols, BT)
    _store_r(do, o2_ptr + base, den_ptr + pid_bh * 2 * T + T, r_ptr + pid_bh * 2 * T + T, t0, T,
             H, D, eps, d_cols, BT)


@triton.jit
def _store_r(do, o_ptr, den_ptr, r_ptr, t0, T, H, D, eps, d_cols, BT: tl.constexpr):
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    o_t = _tile(o_ptr, t0, T, H * D, d_cols, D, BT)
    den = tl.load(den_ptr + rows, mask=row_ok, other=1.0)
    r = -tl.sum(do * o_t, axis=1) / _safe(den, eps)
    tl.store(r_ptr + rows, tl.where(tl.abs(den) < eps, 0.0, r), mask=row_ok)


@triton.jit
def approx_bwd_delta_kernel(
    q_ptr, do_ptr, den_ptr, r_ptr, ds_ptr, dzv_ptr,
    T, H, HKV, G, D, NT, NV, L0, scale, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """grid (cdiv(D, BK)·NV, NT, B*H_kv), NV = cdiv(D, BV) (cfg scan="parallel"): chunk c's own
    contribution to the reverse states, summed over the GQA group's query heads, every chunk at
    once: the [BK, BV] blocks of ΔdS_t = Σ_g (a_t/d_t)ᵀ dO, Δdz_t = Σ_g Σ r_t a_t (its BK
    features, pid_v = 0), Δdsv = Σ_g Σ dO / n (its BV columns, pid_k = 0). Layouts as
    ``approx_fwd_delta_kernel``'s."""
    pid_kv, c, pid_bk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_k, pid_v = pid_kv // NV, pid_kv % NV
    b, hk = pid_bk // HKV, pid_bk % HKV
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    count = (L0 + rows + 1).to(tl.float32)
    d_cols = pid_k * BK + tl.arange(0, BK)
    v_cols = pid_v * BV + tl.arange(0, BV)
    d1 = tl.zeros([BK, BV], dtype=tl.float32)
    d2 = tl.zeros([BK, BV], dtype=tl.float32)
    dz1 = tl.zeros([BK], dtype=tl.float32)
    dz2 = tl.zeros([BK], dtype=tl.float32)
    dsv = tl.zeros([BV], dtype=tl.float32)
    for g in range(G):
        h = hk * G + g
        bh = b * H + h
        q_base = (b * T * H + h) * D
        a1 = _tile(q_ptr + q_base, t0, T, H * D, d_cols, D, BT) * scale  # padded tokens: 0
        a2 = _square(a1)
        den1 = tl.load(den_ptr + bh * 2 * T + rows, mask=row_ok, other=1.0)
        den2 = tl.load(den_ptr + bh * 2 * T + T + rows, mask=row_ok, other=1.0)
        r1 = tl.load(r_ptr + bh * 2 * T + rows, mask=row_ok, other=0.0)
        r2 = tl.load(r_ptr + bh * 2 * T + T + rows, mask=row_ok, other=0.0)
        dz1 += tl.sum(r1[:, None] * a1, axis=0)
        dz2 += tl.sum(r2[:, None] * a2, axis=0)
        g1 = _operand(a1 / _safe(den1, eps)[:, None], q_ptr, DOT_F32)
        g2 = _operand(a2 / _safe(den2, eps)[:, None], q_ptr, DOT_F32)
        do = _tile(do_ptr + q_base, t0, T, H * D, v_cols, D, BT)
        dsv += tl.sum(do / count[:, None], axis=0)
        dop = _operand(do, q_ptr, DOT_F32)
        d1 = tl.dot(tl.trans(g1), dop, acc=d1, input_precision=PREC)
        d2 = tl.dot(tl.trans(g2), dop, acc=d2, input_precision=PREC)
    _store_states(ds_ptr, dzv_ptr, pid_bk * NT + c, pid_k, pid_v, d_cols, v_cols, D, d1, d2,
                       dz1, dz2, dsv)


@triton.jit
def approx_bwd_states_kernel(
    q_ptr, do_ptr, den_ptr, r_ptr, ds_ptr, dzv_ptr, ds0_ptr, dzv0_ptr, dsf_ptr, dzvf_ptr,
    T, H, HKV, G, D, NT, L0, scale, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    """grid (cdiv(D, BK), cdiv(D, BV), B*H_kv) (cfg scan="sequential"): the reverse states after
    every chunk, summed over the group's query heads, in one walk over the chunks (last first):
    dS_t = Σ (a_t/d_t)ᵀ dO ([BK, BV] blocks), dz_t = Σ r_t a_t (pid_v = 0), dsv = Σ dO / n
    (pid_k = 0). Layouts as the forward's states: ds_ptr [B, H_kv, NT, 2, D, D], dzv_ptr
    [B, H_kv, NT, 3, D] (dz1, dz2, dsv).
    HAS_INIT: the walk starts from the final state's gradient (ds0_ptr, dzv0_ptr:
    [B, H_kv, 2, D, D], [B, H_kv, 3, D] fp32) instead of 0; STORE_FINAL: the sum after the
    first chunk, the initial state's gradient, is written to dsf_ptr, dzvf_ptr (same layouts)."""
    pid_k, pid_v, pid_bk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hk = pid_bk // HKV, pid_bk % HKV
    k_cols = pid_k * BK + tl.arange(0, BK)
    v_cols = pid_v * BV + tl.arange(0, BV)
    dS1, dS2, dz1, dz2, dsv = _load_states(ds0_ptr, dzv0_ptr, pid_bk, k_cols, v_cols, D, BK, BV,
                                           HAS_INIT)
    for i in range(NT):
        c = NT - 1 - i
        _store_states(ds_ptr, dzv_ptr, pid_bk * NT + c, pid_k, pid_v, k_cols, v_cols, D, dS1, dS2,
                      dz1, dz2, dsv)
        t0 = c * BT
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < T
        count = (L0 + rows + 1).to(tl.float32)
        for g in range(G):
            h = hk * G + g
            bh = b * H + h
            q_base = (b * T * H + h) * D
            a1 = _tile(q_ptr + q_base, t0, T, H * D, k_cols, D, BT) * scale
            a2 = _square(a1)
            do = _tile(do_ptr + q_base, t0, T, H * D, v_cols, D, BT)
            den1 = tl.load(den_ptr + bh * 2 * T + rows, mask=row_ok, other=1.0)
            den2 = tl.load(den_ptr + bh * 2 * T + T + rows, mask=row_ok, other=1.0)
            r1 = tl.load(r_ptr + bh * 2 * T + rows, mask=row_ok, other=0.0)
            r2 = tl.load(r_ptr + bh * 2 * T + T + rows, mask=row_ok, other=0.0)
            dop = _operand(do, q_ptr, DOT_F32)
            g1 = _operand(a1 / _safe(den1, eps)[:, None], q_ptr, DOT_F32)
            g2 = _operand(a2 / _safe(den2, eps)[:, None], q_ptr, DOT_F32)
            dS1 += tl.dot(tl.trans(g1), dop, input_precision=PREC)
            dS2 += tl.dot(tl.trans(g2), dop, input_precision=PREC)
            dz1 += tl.sum(r1[:, None] * a1, axis=0)
            dz2 += tl.sum(r2[:, None] * a2, axis=0)
            dsv += tl.sum(do / count[:, None], axis=0)
    if STORE_FINAL:
        _store_states(dsf_ptr, dzvf_ptr, pid_bk, pid_k, pid_v, k_cols, v_cols, D, dS1, dS2, dz1,
                      dz2, dsv)


@triton.jit
def _dM_and_E(do_ptr, v_ptr, q_base, kv_base, rd1, rd2, r1, r2, t0, T, H, HKV, D, like_ptr,
              BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """E_t = tril(dO vᵀ / d_t + r_t 1ᵀ), t = 1, 2 ([BT, BT] fp32), dO vᵀ a V-block at a time."""
    dM = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, D, BV):
        v_cols = v0 + tl.arange(0, BV)
        do = _tile(do_ptr + q_base, t0, T, H * D, v_cols, D, BT)
        v = _tile(v_ptr + kv_base, t0, T, HKV * D, v_cols, D, BT)
        dM += tl.dot(_operand(do, like_ptr, DOT_F32), tl.trans(_operand(v, like_ptr, DOT_F32)),
                     input_precision=PREC)
    causal = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]  # [i, j]: j <= i
    E1 = tl.where(causal, dM * rd1[:, None] + r1[:, None], 0.0)
    E2 = tl.where(causal, dM * rd2[:, None] + r2[:, None], 0.0)
    return E1, E2


@triton.jit
def _bwd_row_terms(den_ptr, r_ptr, pid_bh, rows, row_ok, T, eps):
    """1/d_t and r_t of one head's rows (t = 1, 2)."""
    den1 = tl.load(den_ptr + pid_bh * 2 * T + rows, mask=row_ok, other=1.0)
    den2 = tl.load(den_ptr + pid_bh * 2 * T + T + rows, mask=row_ok, other=1.0)
    r1 = tl.load(r_ptr + pid_bh * 2 * T + rows, mask=row_ok, other=0.0)
    r2 = tl.load(r_ptr + pid_bh * 2 * T + T + rows, mask=row_ok, other=0.0)
    return 1.0 / _safe(den1, eps), 1.0 / _safe(den2, eps), r1, r2


@triton.jit
def approx_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, den_ptr, r_ptr, s_ptr, zv_ptr, dq_ptr,
    T, H, HKV, G, D, NT, scale, eps,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """grid (NT, B*H): dq of query head h in chunk c: σ (da1 + √2 q~ ⊙ da2) with
    da_t = E_t b_t + (dO/d_t) S_tᵀ + r_t z_tᵀ (dO and S_t a V-block of BV columns at a time).
    s_ptr, zv_ptr: the forward's chunk states ([B, H_kv, NT, 2, D, D], [B, H_kv, NT, 3, D])."""
    c, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    st = b * HKV + hk
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    d_ok = d_cols < D
    q_base = (b * T * H + h) * D
    kv_base = (b * T * HKV + hk) * D
    rd1, rd2, r1, r2 = _bwd_row_terms(den_ptr, r_ptr, pid_bh, rows, row_ok, T, eps)
    s_base = (st * NT + c) * 2 * D * D
    z_base = (st * NT + c) * 3 * D
    da1 = tl.zeros([BT, BD], dtype=tl.float32)
    da2 = tl.zeros([BT, BD], dtype=tl.float32)
    for v0 in range(0, D, BV):  # the earlier chunks' part, (dO/d_t) S_tᵀ
        v_cols = v0 + tl.arange(0, BV)
        do = _tile(do_ptr + q_base, t0, T, H * D, v_cols, D, BT)
        s_off = s_base + d_cols[:, None] * D + v_cols[None, :]
        s_mask = d_ok[:, None] & (v_cols[None, :] < D)
        S1 = _operand(tl.load(s_ptr + s_off, mask=s_mask, other=0.0), q_ptr, DOT_F32)
        S2 = _operand(tl.load(s_ptr + s_off + D * D, mask=s_mask, other=0.0), q_ptr, DOT_F32)
        da1 += tl.dot(_operand(do * rd1[:, None], q_ptr, DOT_F32), tl.trans(S1),
                      input_precision=PREC)
        da2 += tl.dot(_operand(do * rd2[:, None], q_ptr, DOT_F32), tl.trans(S2),
                      input_precision=PREC)
    E1, E2 = _dM_and_E(do_ptr, v_ptr, q_base, kv_base, rd1, rd2, r1, r2, t0, T, H, HKV, D, q_ptr,
                       BT, BV, PREC, DOT_F32)
    b1 = _tile(k_ptr + kv_base, t0, T, HKV * D, d_cols, D, BT) * scale
    z1 = tl.load(zv_ptr + z_base + d_cols, mask=d_ok, other=0.0)
    z2 = tl.load(zv_ptr + z_base + D + d_cols, mask=d_ok, other=0.0)
    da1 += tl.dot(_operand(E1, q_ptr, DOT_F32), _operand(b1, q_ptr, DOT_F32),
                  input_precision=PREC) + r1[:, None] * z1[None, :]
    da2 += tl.dot(_operand(E2, q_ptr, DOT_F32), _operand(_square(b1), q_ptr, DOT_F32),
                  input_precision=PREC) + r2[:, None] * z2[None, :]
    a1 = _tile(q_ptr + q_base, t0, T, H * D, d_cols, D, BT) * scale
    dq = scale * (da1 + SQRT2 * a1 * da2)
    offs = q_base + rows[:, None] * (H * D) + d_cols[None, :]
    tl.store(dq_ptr + offs, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def approx_bwd_dk_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, den_ptr, r_ptr, ds_ptr, dzv_ptr, dk_ptr,
    T, H, HKV, G, D, NT, scale, eps,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """grid (NT, B*H): query head h's share of dk in chunk c ([B, T, H, D]): σ (db1 + √2 k~ ⊙ db2)
    with db_t = E_tᵀ a_t, plus v dS_tᵀ + dz_t (the later chunks) once per group, from g = 0.
    ds_ptr, dzv_ptr: the reverse states ([B, H_kv, NT, 2, D, D], [B, H_kv, NT, 3, D])."""
    c, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    st = b * HKV + hk
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    d_ok = d_cols < D
    q_base = (b * T * H + h) * D
    kv_base = (b * T * HKV + hk) * D
    rd1, rd2, r1, r2 = _bwd_row_terms(den_ptr, r_ptr, pid_bh, rows, row_ok, T, eps)
    E1, E2 = _dM_and_E(do_ptr, v_ptr, q_base, kv_base, rd1, rd2, r1, r2, t0, T, H, HKV, D, q_ptr,
                       BT, BV, PREC, DOT_F32)
    a1 = _tile(q_ptr + q_base, t0, T, H * D, d_cols, D, BT) * scale
    db1 = tl.dot(tl.trans(_operand(E1, q_ptr, DOT_F32)), _operand(a1, q_ptr, DOT_F32),
                 input_precision=PREC)
    db2 = tl.dot(tl.trans(_operand(E2, q_ptr, DOT_F32)), _operand(_square(a1), q_ptr, DOT_F32),
                 input_precision=PREC)
    if h % G == 0:
        s_base = (st * NT + c) * 2 * D * D
        z_base = (st * NT + c) * 3 * D
        for v0 in range(0, D, BV):
            v_cols = v0 + tl.arange(0, BV)
            v = _operand(_tile(v_ptr + kv_base, t0, T, HKV * D, v_cols, D, BT), q_ptr, DOT_F32)
            s_off = s_base + d_cols[:, None] * D + v_cols[None, :]
            s_mask = d_ok[:, None] & (v_cols[None, :] < D)
            dS1 = _operand(tl.load(ds_ptr + s_off, mask=s_mask, other=0.0), q_ptr, DOT_F32)
            dS2 = _operand(tl.load(ds_ptr + s_off + D * D, mask=s_mask, other=0.0), q_ptr,
                           DOT_F32)
            db1 += tl.dot(v, tl.trans(dS1), input_precision=PREC)
            db2 += tl.dot(v, tl.trans(dS2), input_precision=PREC)
        dz1 = tl.load(dzv_ptr + z_base + d_cols, mask=d_ok, other=0.0)
        dz2 = tl.load(dzv_ptr + z_base + D + d_cols, mask=d_ok, other=0.0)
        valid = row_ok[:, None]  # padded tokens get no dz
        db1 += tl.where(valid, dz1[None, :], 0.0)
        db2 += tl.where(valid, dz2[None, :], 0.0)
    b1 = _tile(k_ptr + kv_base, t0, T, HKV * D, d_cols, D, BT) * scale
    dk = scale * (db1 + SQRT2 * b1 * db2)
    offs = q_base + rows[:, None] * (H * D) + d_cols[None, :]
    tl.store(dk_ptr + offs, dk.to(dk_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def approx_bwd_dv_kernel(
    q_ptr, k_ptr, do_ptr, den_ptr, ds_ptr, dzv_ptr, dv_ptr,
    T, H, HKV, G, D, NT, L0, scale, eps,
    BT: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """grid (cdiv(D, BV), NT, B*H): query head h's share of dv ([B, T, H, D]):
    tril(A1/d1 + A2/d2 + 1/n)ᵀ dO, plus b1 dS1 + b2 dS2 + dsv once per group (g = 0).
    ds_ptr, dzv_ptr: the reverse states ([B, H_kv, NT, 2, D, D], [B, H_kv, NT, 3, D])."""
    pid_v, c, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // H, pid_bh % H
    hk = h // G
    st = b * HKV + hk
    t0 = c * BT
    rows = t0 + tl.arange(0, BT)
    row_ok = rows < T
    d_cols = tl.arange(0, BD)
    v_cols = pid_v * BV + tl.arange(0, BV)
    v_ok = v_cols < D
    q_base = (b * T * H + h) * D
    kv_base = (b * T * HKV + hk) * D
    a1 = _tile(q_ptr + q_base, t0, T, H * D, d_cols, D, BT) * scale
    b1 = _tile(k_ptr + kv_base, t0, T, HKV * D, d_cols, D, BT) * scale
    a2, b2 = _square(a1), _square(b1)
    den1 = tl.load(den_ptr + pid_bh * 2 * T + rows, mask=row_ok, other=1.0)
    den2 = tl.load(den_ptr + pid_bh * 2 * T + T + rows, mask=row_ok, other=1.0)
    count = (L0 + rows + 1).to(tl.float32)
    causal = tl.arange(0, BT)[None, :] <= tl.arange(0, BT)[:, None]  # [i, j]: j <= i
    A1 = tl.dot(_operand(a1, q_ptr, DOT_F32), tl.trans(_operand(b1, q_ptr, DOT_F32)),
                input_precision=PREC)
    A2 = tl.dot(_operand(a2, q_ptr, DOT_F32), tl.trans(_operand(b2, q_ptr, DOT_F32)),
                input_precision=PREC)
    P = A1 / _safe(den1, eps)[:, None] + A2 / _safe(den2, eps)[:, None] + 1.0 / count[:, None]
    P = tl.where(causal & row_ok[:, None], P, 0.0)
    do = _tile(do_ptr + q_base, t0, T, H * D, v_cols, D, BT)
    dv = tl.dot(tl.trans(_operand(P, q_ptr, DOT_F32)), _operand(do, q_ptr, DOT_F32),
                input_precision=PREC)
    if h % G == 0:
        s_off = (st * NT + c) * 2 * D * D + d_cols[:, None] * D + v_cols[None, :]
        s_mask = (d_cols[:, None] < D) & v_ok[None, :]
        dS1 = tl.load(ds_ptr + s_off, mask=s_mask, other=0.0)
        dS2 = tl.load(ds_ptr + s_off + D * D, mask=s_mask, other=0.0)
        dv += tl.dot(_operand(b1, q_ptr, DOT_F32), _operand(dS1, q_ptr, DOT_F32),
                     input_precision=PREC)
        dv += tl.dot(_operand(b2, q_ptr, DOT_F32), _operand(dS2, q_ptr, DOT_F32),
                     input_precision=PREC)
        dsv = tl.load(dzv_ptr + (st * NT + c) * 3 * D + 2 * D + v_cols, mask=v_ok, other=0.0)
        dv += dsv[None, :]
    offs = q_base + rows[:, None] * (H * D) + v_cols[None, :]
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
