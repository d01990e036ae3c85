"""``ASAChunkFunction``: the Triton kernels of ``chunk.py`` wrapped as one autograd Function.

Layout ``[B, T, H, D]`` (k, v: ``[B, T, H_kv, D]``, GQA), ``p_q, p_k: [H, D, m]``; the math and
its conventions are those of ``megatron_subq.ops.asa`` (which tests compare against).
Gradients flow to q, k, v, p_q and p_k, and through the states: the initial state (S0, z0;
fp32) gets its exact gradient, and the final state's gradient flows back into q, k, v, P and the
initial state (context parallelism's state passing trains through them). The reverse scan
starts at the final state's gradient and the initial state's gradient is where it ends (its sums
past the first chunk); "mean" normalisation, whose count of earlier tokens is Σ_m z0 unless a
count is given (``tokens_before``), adds that count's gradient to z0's. Without a state and
without a gradient on the final state the backward does exactly what it did before (bit for bit,
no extra work). Packed sequences (``cu_seqlens``) take no state.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..checks import check_cu_seqlens, triton_interpreting
from ..common import cached_config, check_int32_offsets, env_overrides
from ..launch import cdiv, fast, pow2
from ..scan import scan as _scan, scan_pair as _scan_pair
from .chunk import (
    asa_bwd_block_kernel,
    asa_bwd_dp_kernel,
    asa_bwd_r_kernel,
    asa_bwd_states_kernel,
    asa_chunk_delta_kernel,
    asa_dp_reduce_kernel,
    asa_fwd_out_kernel,
    asa_fwd_states_kernel,
)
from .state import ASAState

NORM_CODES = {"linear": 0, "none": 1, "mean": 2}
DP_REDUCE_BLOCK = 1024  # columns per program of asa_dp_reduce_kernel
LAUNCH_ENV = "MEGATRON_SUBQ_ASA_LAUNCH"  # JSON overrides of the launch config (benchmark sweeps)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, pow2(n))


@dataclass(frozen=True)
class LaunchConfig:
    """ASA's fixed launch configuration (no autotuning: it must also run under TRITON_INTERPRET=1).

    Tiles: BT tokens per chunk (the intra-chunk products are BT x BT tensor-core tiles), BD, BM
    the padded head dim and feature count, BDT the D tile (a power of two, 16 <= BDT <= BD): the
    feature logits q P_Q, k P_K accumulate over D tiles of BDT columns, dq = dl P_Qᵀ,
    dk = dl P_Kᵀ are computed and written per D tile, and the dP kernel runs one program per
    D tile, so that no program holds a [BT, BD] slice of q/k or a [BD, BM] slice of P wider
    than BDT (d_h = 512); BDT = BD is the untiled form, bit for bit. BV_* the Dv block per
    kernel (BV_state: the
    sequential state scans; BV_delta: the per-chunk delta kernel; BV_out, BV_bwd: the output and
    gradient kernels); *_warps the warps per kernel; stages the software-pipelining depth; PREC
    the dots' precision (tf32 is ignored for 16-bit inputs); CPG chunks per program of the dP
    reduction ("auto": about two programs per SM, at most 16 chunks each).
    scan: "parallel" (per-chunk deltas in parallel, then a streaming prefix sum) or
    "sequential" (one fused loop over chunks per head: fewer bytes, latency grows with T/BT);
    scan_block, scan_unroll, scan_warps, scan_stages: the prefix-sum kernel's values per program,
    chunks per step, warps and stages.
    bwd_rows, out_rows: rows per program of the gradient and output kernels, a power of two from
    16 to BT; the program meets its chunk's other row blocks in RB x RB tiles.
    Switches (on by default; off, the form they replaced, kept for the tests):
    keep_states (the forward saves its chunk states for the backward instead of recomputing
    them: memory for time); fused_scan (the S and z prefix sums in one launch); r_kernel (the
    linear normalisation's r = -(dO·o)/den in ``asa_bwd_r_kernel`` instead of torch ops on fp32
    copies); r_fused (with r_kernel, the linear normalisation, the parallel scan and one Dv block
    of the delta kernel: that kernel computes r as it reads dO and stores it, one launch fewer);
    dl_half (the feature-logit gradients between the gradient and dP kernels in the
    inputs' half dtype); states_half, deltas_half (bf16 inputs only: the stored chunk states and
    the per-chunk deltas in bf16, running sums and final state fp32; never fp16, whose range a
    state, a sum over every earlier token, outgrows at long T)."""
    BT: int
    BD: int
    BDT: int
    BM: int
    BV_state: int
    BV_delta: int
    delta_warps: int
    BV_out: int
    BV_bwd: int
    PREC: str
    state_warps: int
    out_warps: int
    bwd_warps: int
    dp_warps: int
    stages: int
    CPG: Union[int, str]
    scan: str
    scan_block: int
    scan_unroll: int
    scan_warps: int
    scan_stages: int
    keep_states: bool
    fused_scan: bool
    r_kernel: bool
    r_fused: bool
    dl_half: bool
    states_half: bool
    deltas_half: bool
    bwd_rows: int
    out_rows: int

    def __hash__(self) -> int:
        """Hashed once (the launch factories below are cached on configs, ~30 fields)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


@cached_config(LAUNCH_ENV)
def launch_config(D: int, m: int, Dv: int, dtype: torch.dtype) -> LaunchConfig:
    """The launch config for head dims D, Dv and m features in ``dtype``, with the overrides of
    ``$MEGATRON_SUBQ_ASA_LAUNCH`` (JSON, any field); cached per arguments and environment
    (``common.cached_config``). The interpreter keeps 64-token chunks and
    32-row blocks, so that the CPU tests' lengths around 64 straddle a chunk and tile the rows."""
    # compiled, the feature tile is at least 64 wide: with m padded to 32, fp16/bf16 inputs hit an
    # illegal memory access on the GPU (fp32 was fine); padded features are masked to zero
    interpreting = triton_interpreting()
    BD, BV_all = _pow2(D), _pow2(Dv)
    BM = _pow2(m, floor=16 if interpreting else 64)
    big_tiles = max(BD, BM, BV_all) > 128 or dtype == torch.float32
    # fp32 wider than 128: its "ieee" dots unroll to FMA loops, and the gradient kernel at d_h 256
    # in one 256-wide D tile of 64 rows did not finish compiling in 10 minutes (an H200 test,
    # 2026-11-27; sm_90 offline with tools/kernel_spills.py: still compiling after 10 min, against
    # 65 s with 128-wide D tiles of 32 rows, d_h 512's form, GPU-verified in fp32): that form
    fp32_wide = dtype == torch.float32 and max(BD, BV_all) > 128
    cfg = LaunchConfig(
        # 128-token chunks halve the chunk states and scan steps; tiles wider than 128 (d_h or
        # m of 256) and fp32 tiles (twice the bytes; fp32 is for checking, not for speed) keep
        # 64 so a chunk's tiles still fit in registers and shared memory
        BT=64 if interpreting or big_tiles else 128, BD=BD, BM=BM,
        # the D tile: compiled, at most 128 wide, so that d_h of 256 and 512 load q/k and P in
        # [64, 128] and [128, BM <= 128] slices (the sizes d_h = 128 runs at; BT is 64 for them,
        # big_tiles) and the features cost D/128 accumulating dots; in the interpreter the whole
        # BD (one tile, the untiled code), the tests tiling it through the override.
        # d_h = 512 (the paper's ASA 1.3B head, m = 64 by default, at most 128), compiled, all
        # from the rules here, none measured yet: BT = 64 (big_tiles: [64, ·] fp32 accumulators,
        # as d_h 256 ran), BDT = 128, BM = m padded (64 or 128), BV_delta = BV_bwd = 64 and
        # BV_state = 64 (Dv = 512 in 8 blocks: more programs, nothing wider than 128 live),
        # BV_out = 128 (4 blocks), 4 warps everywhere (the delta kernel's 8 are for 128-wide
        # tiles only): per program the widest live tiles are then [64, 128] of q/k/v/dO, [128,
        # 128] of P or a state block, [64, BM] of features. The gradient kernel recomputes the
        # features of each block it meets (D/128 dots each), so its cost grows with d_h
        # (docs/benchmarks.md: what a GPU session should still measure). Its rows: below
        # d_h <= 256 compiled keeps the whole BD (the GPU-verified untiled kernels, bit for bit)
        # until the GPU A/B (test_d_tiles_launch_gpu) says a 128-wide tile is as good there
        BDT=BD if interpreting or (BD <= 256 and not fp32_wide) else 128,
        BV_state=min(64, BV_all),  # sequential state scans: split Dv for more programs
        # the per-chunk delta kernel: one program per chunk (the features computed once), 8
        # warps without spills; tiles wider than 128 and fp32 keep 64 columns and 4 warps
        BV_delta=min(64 if big_tiles else 128, BV_all), delta_warps=4 if big_tiles else 8,
        BV_out=min(128, BV_all),
        BV_bwd=min(64 if big_tiles else 128, BV_all),
        PREC="ieee" if dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
        state_warps=4, out_warps=4, bwd_warps=4, dp_warps=4,
        stages=1, CPG=16 if interpreting else "auto", scan="parallel", scan_block=1024,
        scan_unroll=8, scan_warps=4, scan_stages=1, keep_states=True, fused_scan=True,
        r_kernel=True, r_fused=True, dl_half=True,
        states_half=dtype == torch.bfloat16, deltas_half=dtype == torch.bfloat16,
        # the gradient kernel at d_h or d_v of 512 (8 Dv blocks of 64, unrolled): 32 rows; at
        # 64, sm_90 compiles (tools/kernel_spills.py, Triton 3.9, no GPU) spilled 12.5 KB per
        # thread on the key side and 3.5 KB on the query side, at 32 rows 1.3 and 0.5 KB
        # (d_h 128 at 64 rows: 3.1 and 0.4 KB); not timed yet (test_d_tiles_launch_gpu: the A/B)
        bwd_rows=32 if interpreting or max(BD, BV_all) >= 512 or fp32_wide else 64,
        out_rows=32 if interpreting else 64,
    )
    cfg = env_overrides(cfg, LAUNCH_ENV)
    # rows per program, in blocks of a chunk (64-token chunks: one block)
    cfg = dataclasses.replace(cfg, bwd_rows=min(cfg.bwd_rows, cfg.BT),
                              out_rows=min(cfg.out_rows, cfg.BT), BDT=min(cfg.BDT, cfg.BD))
    if cfg.BDT < 16 or cfg.BDT & (cfg.BDT - 1):
        raise ValueError(f"ASA launch config: BDT={cfg.BDT}; allowed a power of two from 16 to "
                         f"BD={cfg.BD}")
    for name in ("bwd_rows", "out_rows"):
        rows = getattr(cfg, name)
        if rows < 16 or cfg.BT % rows:
            raise ValueError(f"ASA launch config: {name}={rows}; allowed a power of two from "
                             f"16 to BT={cfg.BT}")
    return cfg


@functools.lru_cache(maxsize=None)
def kernel_verified(D: int, m: int, Dv: int) -> bool:
    """Whether the GPU tests have verified the compiled kernels at these sizes: what
    ``ops.asa_attention(impl=None)`` picks the kernel for on CUDA (elsewhere the reference runs).
    Everything ``kernel_supports`` allows except d_h or d_v of 512 with m <= 32 (no GPU test at
    that size). d_h 256/512 verified on an H200 on 2026-11-27: forward and every gradient
    (fp32/fp16/bf16), packed sequences (fp32/bf16) and prefill + decode, m 64 and 128."""
    return kernel_supports(D, m, Dv) and not (max(_pow2(D), _pow2(Dv)) == 512 and _pow2(m) < 64)


@functools.lru_cache(maxsize=None)
def kernel_supports(D: int, m: int, Dv: int) -> bool:
    """Whether the compiled (GPU) kernels are allowed for these sizes.

    Verified by the GPU tests (tests/test_asa_kernel.py, H100, 2026-11-22): D and Dv padded to
    64, 128 or 256 and m up to 256 (the feature tile padded to at least 64, see
    ``launch_config``) with D, Dv <= 128 (d_h 128 with m 256), and d_h 256 with m <= 64.
    Since the D tiling (launch field ``BDT``): D and Dv padded up to 512 with m <= 128 (the
    paper's ASA 1.3B head: d_h = 512; compiled, d_h 512 runs BDT = 128, d_h <= 256 the untiled
    kernels), verified by the ``gpu``-marked tests at d_h 256 and 512 on an H200 (2026-11-27:
    ``test_kernel_d256_d512_gpu``, the packed and prefill / decode tests beside it), except
    m = 32 at 512 (``kernel_verified``: ``impl=None`` keeps the reference there). Other sizes
    are refused on CUDA. The interpreter (CPU) runs every size.
    """
    pD, pDv, pm = _pow2(D), _pow2(Dv), _pow2(m)
    if pD not in (64, 128, 256, 512) or pDv not in (64, 128, 256, 512):
        return False
    if max(pD, pDv) <= 128:
        return pm in (32, 64, 128, 256)
    return pm in (32, 64, 128)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _token_major(x: torch.Tensor) -> bool:
    """Whether ``[B, T, H, ·]`` x is laid out ``[T, B, H, ·]`` in memory (a transposed view of
    Megatron's ``[s, b, h, d]``): then o and the gradients are allocated that way too, so that
    the layer's transposes, its head reshape and the QKV split's backward need no copies
    (``chunk._token_rows``). With B = 1 both layouts are the same."""
    return x.shape[0] > 1 and x.stride(1) > x.stride(0)


def _empty_rows(B: int, T: int, H: int, n: int, dtype, device, token_major: bool) -> torch.Tensor:
    """An uninitialised ``[B, T, H, n]`` tensor, memory ``[T, B, H, n]`` when ``token_major``."""
    if token_major:
        return torch.empty(T, B, H, n, dtype=dtype, device=device).transpose(0, 1)
    return torch.empty(B, T, H, n, dtype=dtype, device=device)


def _like_rows(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x in ``like``'s memory layout (``like`` is dense: o): x itself when the strides agree."""
    return x if x.stride() == like.stride() else torch.empty_like(like, dtype=x.dtype).copy_(x)


def chunk_table(bounds: list, BT: int, device) -> torch.Tensor:
    """Packed sequences ``bounds = [0, end_1, ..., T]`` cut into chunks of at most ``BT`` tokens
    that never straddle a boundary: int32 ``[NT, 4]`` rows (start, stop, seq_start, seq_stop).

    Built on the host (the kernels' grids need NT); a chunk table is what lets every kernel keep
    its dense per-chunk structure while the state scans restart at each sequence."""
    rows = [(start, min(start + BT, seq_stop), seq_start, seq_stop)
            for seq_start, seq_stop in zip(bounds, bounds[1:])
            for start in range(seq_start, seq_stop, BT)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)


def _num_chunks(T: int, cfg, chunks: Optional[torch.Tensor]) -> int:
    return cdiv(T, cfg.BT) if chunks is None else chunks.shape[0]


def _state_dtype(x: torch.Tensor, cfg) -> torch.dtype:
    """The stored chunk states' dtype: the inputs' half dtype with cfg states_half, else fp32."""
    return x.dtype if cfg.states_half else torch.float32


def _chunk_delta(x, p, y, den, r, cfg, H, G, backward: bool, norm: int, chunks=None, o=None):
    """Per-chunk state contributions (``asa_chunk_delta_kernel``): [B, H, NT, m, Dv], [.., m].
    ``o`` (backward, linear, one Dv block): the kernel computes r from o and dO and stores it
    to ``r`` (uninitialised here) instead of reading it (``_fuse_r``)."""
    B, T, _, D = x.shape
    Dv, m = y.shape[3], p.shape[2]
    NT = _num_chunks(T, cfg, chunks)
    delta = torch.empty(B, H, NT, m, Dv, device=x.device,
                        dtype=x.dtype if cfg.deltas_half else torch.float32)
    # every program writes its dz except in the backward without the linear normalisation
    # (no r), where the z sums are unused but still scanned: zeros then, else no fill launch
    alloc = torch.zeros if backward and norm != 0 else torch.empty
    dz = alloc(B, H, NT, m, dtype=torch.float32, device=x.device)
    den = delta if den is None else den  # unread in the forward
    r = delta if r is None else r
    launch = _delta_launch(asa_chunk_delta_kernel, cfg, B, T, H, G, D, m, Dv, NT,
                           x.stride()[:3], y.stride()[:3], backward, norm, chunks is not None,
                           o is not None)
    tensors = dict(x_ptr=x, p_ptr=p, y_ptr=y, den_ptr=den, r_ptr=r, delta_ptr=delta, dz_ptr=dz,
                   chunks_ptr=chunks if chunks is not None else delta)
    if o is not None:
        tensors["o_ptr"] = o
    launch(**tensors)
    return delta, dz


@functools.lru_cache(maxsize=1024)
def _delta_launch(kernel, cfg, B, T, H, G, D, m, Dv, NT, sx, sy, backward, norm, varlen,
                  fused_r):
    """The delta kernel's launch for these sizes with its non-tensor arguments bound
    (``launch.Bound``: a launch then keys only on its tensors). So are the launches below; the
    kernel is part of each key (tests stand in for kernels)."""
    return fast(kernel).bind(
        (NT, cdiv(Dv, cfg.BV_delta), B * H), T=T, H=H, G=G, D=D, M=m, DV=Dv, NT=NT, sxb=sx[0],
        sxt=sx[1], sxh=sx[2], syb=sy[0], syt=sy[1], syh=sy[2], BT=cfg.BT, BD=cfg.BD, BDT=cfg.BDT,
        BM=cfg.BM, BV=cfg.BV_delta, BACKWARD=backward, NORM=norm, PREC=cfg.PREC, VARLEN=varlen,
        R_FUSED=fused_r, num_warps=cfg.delta_warps, num_stages=cfg.stages)


def _chunk_states(k, v, p_k, s0, z0, cfg, H, G, store_final: bool, chunks=None):
    """S_c, z_c before every chunk (fp32, [B, H, NT, m, Dv] / [B, H, NT, m]), and the final
    state when asked. Packed sequences (a chunk table) always take the parallel scan."""
    B, T, _, D = k.shape
    Dv, m = v.shape[3], p_k.shape[2]
    if cfg.scan == "parallel" or chunks is not None:
        delta, dz = _chunk_delta(k, p_k, v, None, None, cfg, H, G, False, 0, chunks)
        dtype = _state_dtype(k, cfg)
        if cfg.fused_scan:
            return _scan_pair(delta, dz, s0, z0, cfg, False, store_final, chunks, dtype)
        states, s_final = _scan(delta, s0, cfg, False, store_final, chunks, dtype)
        zs, z_final = _scan(dz, z0, cfg, False, store_final, chunks)
        return states, zs, (s_final, z_final) if store_final else None
    if cfg.scan != "sequential":
        raise ValueError(f"ASA launch config: scan={cfg.scan!r}; allowed 'parallel' or "
                         "'sequential'")
    NT = cdiv(T, cfg.BT)
    states = torch.empty(B, H, NT, m, Dv, dtype=torch.float32, device=k.device)
    zs = torch.empty(B, H, NT, m, dtype=torch.float32, device=k.device)
    s_final, z_final = states, zs  # unwritten unless store_final
    if store_final:
        s_final = torch.empty(B, H, m, Dv, dtype=torch.float32, device=k.device)
        z_final = torch.empty(B, H, m, dtype=torch.float32, device=k.device)
    has_s0 = s0 is not None
    grid = (cdiv(Dv, cfg.BV_state), B * H)
    fast(asa_fwd_states_kernel)[grid](
        k_ptr=k, v_ptr=v, pk_ptr=p_k, s0_ptr=s0 if has_s0 else states, z0_ptr=z0 if has_s0 else zs,
        states_ptr=states, zs_ptr=zs, st_ptr=s_final, zt_ptr=z_final, T=T, H=H, G=G, D=D, M=m,
        DV=Dv, NT=NT, skb=k.stride(0), skt=k.stride(1), skh=k.stride(2), svb=v.stride(0),
        svt=v.stride(1), svh=v.stride(2), BT=cfg.BT, BD=cfg.BD, BDT=cfg.BDT, BM=cfg.BM,
        BV=cfg.BV_state,
        HAS_S0=has_s0, STORE_FINAL=store_final, PREC=cfg.PREC, num_warps=cfg.state_warps,
        num_stages=cfg.stages)
    return states, zs, (s_final, z_final) if store_final else None


def _reverse_states(q, p_q, d_o, den, r, cfg, norm: int, NT: int, chunks=None, init=None,
                    store_final: bool = False, o=None):
    """dS_c = Σ_{chunks > c} q'ᵀ g, dz_c = Σ_{chunks > c} q'ᵀ r: [B, H, NT, m, Dv] / [.., m]
    (chunks of the same sequence only, with a chunk table), and (store_final) the sums past the
    first chunk, the initial state's gradient (fp32 ``([B, H, m, Dv], [B, H, m])``), or None.
    ``init``: None or the final state's gradient (fp32, contiguous, the same shapes), where the
    reverse sums start (the final state is the initial one plus every chunk's sums). ``o``:
    r is computed by the delta kernel into ``r`` (``_fuse_r``; the parallel scan only)."""
    B, T, H, D = q.shape
    Dv, m = d_o.shape[3], p_q.shape[2]
    ds0, dz0 = init if init is not None else (None, None)
    if cfg.scan == "parallel" or chunks is not None:
        delta, dz = _chunk_delta(q, p_q, d_o, den, r, cfg, H, 1, True, norm, chunks, o)
        dtype = _state_dtype(q, cfg)
        if cfg.fused_scan:
            return _scan_pair(delta, dz, ds0, dz0, cfg, True, store_final, chunks, dtype)
        dstates, s_final = _scan(delta, ds0, cfg, True, store_final, chunks, dtype)
        dzs, z_final = _scan(dz, dz0, cfg, True, store_final, chunks)
        return dstates, dzs, (s_final, z_final) if store_final else None
    dstates = torch.empty(B, H, NT, m, Dv, dtype=torch.float32, device=q.device)
    dzs = torch.empty(B, H, NT, m, dtype=torch.float32, device=q.device)
    ds_final, dz_final = dstates, dzs  # unwritten unless store_final
    if store_final:
        ds_final = torch.empty(B, H, m, Dv, dtype=torch.float32, device=q.device)
        dz_final = torch.empty(B, H, m, dtype=torch.float32, device=q.device)
    fast(asa_bwd_states_kernel)[(cdiv(Dv, cfg.BV_state), B * H)](
        q_ptr=q, pq_ptr=p_q, do_ptr=d_o, den_ptr=den, r_ptr=r, dstates_ptr=dstates, dzs_ptr=dzs,
        ds0_ptr=ds0 if init is not None else dstates, dz0_ptr=dz0 if init is not None else dzs,
        dsf_ptr=ds_final, dzf_ptr=dz_final,
        T=T, H=H, D=D, M=m, DV=Dv, NT=NT, sqb=q.stride(0), sqt=q.stride(1), sqh=q.stride(2),
        BT=cfg.BT, BD=cfg.BD, BDT=cfg.BDT, BM=cfg.BM, BV=cfg.BV_state, NORM=norm,
        PREC=cfg.PREC, HAS_INIT=init is not None, STORE_FINAL=store_final, B=B,
        TMAJOR=_token_major(d_o), num_warps=cfg.state_warps, num_stages=cfg.stages)
    return dstates, dzs, (ds_final, dz_final) if store_final else None


def _linear_r(d_o, o, den, cfg) -> torch.Tensor:
    """r = −(dO·o)/den per token, [B, H, T] fp32 (``asa_bwd_r_kernel``); dO, o dense, in one
    layout (``_token_major``)."""
    B, T, H, Dv = o.shape
    r = torch.empty(B, H, T, dtype=torch.float32, device=o.device)
    _r_launch(asa_bwd_r_kernel, cfg.BT, B, T, H, Dv, _token_major(o))(
        do_ptr=d_o, o_ptr=o, den_ptr=den, r_ptr=r)
    return r


@functools.lru_cache(maxsize=1024)
def _r_launch(kernel, BT, B, T, H, Dv, tmajor):
    return fast(kernel).bind((cdiv(T, BT), B * H), T=T, H=H, DV=Dv, BT=BT, BV=_pow2(Dv), B=B,
                             TMAJOR=tmajor, num_warps=4)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fuse_r(cfg, norm: int, Dv: int, chunks) -> bool:
    """Whether the backward's delta kernel computes the linear normalisation's r (cfg r_fused):
    it reads dO row blocks of BV_delta columns, so only when one block holds all of Dv, and
    only on the parallel scan's path (the sequential one has no delta kernel)."""
    return (norm == 0 and cfg.r_kernel and cfg.r_fused and cdiv(Dv, cfg.BV_delta) == 1
            and (cfg.scan == "parallel" or chunks is not None))


def _param_grads(q, k, dlq, dlk, G: int, cfg, dtype) -> tuple:
    """dP_Q[h] = Σ_{b,t} q[b, t, h]ᵀ dℓ_q[b, t, h] and dP_K[h] = Σ_{b,t} k[b, t, h // G]ᵀ
    dℓ_k[b, t, h]: two ``[H, D, m]`` tensors in ``dtype``, summed in fp32. Two launches: both
    sides' partial sums (one per group of CPG chunks) in one (``asa_bwd_dp_kernel``), their
    reduction and cast in the other (``asa_dp_reduce_kernel``); host time at short lengths is
    what this saves (a launch and torch op pair per side before, docs/benchmarks.md)."""
    B, T, _, D = q.shape
    H, m = dlq.shape[2], dlq.shape[3]
    NT = cdiv(T, cfg.BT)
    cpg = cfg.CPG
    if cpg == "auto":
        cpg = cdiv(NT * B * H, 2 * _sm_count(q.device))
    cpg = max(1, min(cpg, 16, NT))
    n_groups = cdiv(NT, cpg)
    check_int32_offsets("asa_attention_kernel", feature_grad_partials=2 * n_groups * B * H * D * m)
    part = torch.empty(2, n_groups, B, H, D, m, dtype=torch.float32, device=q.device)
    dp = torch.empty(2, H, D, m, dtype=dtype, device=q.device)
    launch, reduce = _dp_launches(asa_bwd_dp_kernel, asa_dp_reduce_kernel, cfg, B, T, H, G, D,
                                  m, NT, cpg, q.stride()[:3], k.stride()[:3])
    launch(q_ptr=q, k_ptr=k, dlq_ptr=dlq, dlk_ptr=dlk, dp_part_ptr=part)
    reduce(part_ptr=part, dp_ptr=dp)
    return dp.unbind(0)


@functools.lru_cache(maxsize=1024)
def _dp_launches(kernel, reduce_kernel, cfg, B, T, H, G, D, m, NT, cpg, sq, sk):
    n_groups, N = cdiv(NT, cpg), H * D * m
    return (fast(kernel).bind(
        (n_groups, cdiv(D, cfg.BDT), 2 * B * H), T=T, H=H, G=G, D=D, M=m, NT=NT, CPG=cpg,
        sqb=sq[0], sqt=sq[1], sqh=sq[2], skb=sk[0], skt=sk[1], skh=sk[2], BDT=cfg.BDT,
        BT=cfg.BT, BM=cfg.BM, PREC=cfg.PREC, num_warps=cfg.dp_warps, num_stages=cfg.stages),
        fast(reduce_kernel).bind((cdiv(N, DP_REDUCE_BLOCK), 2), R=n_groups * B, N=N,
                                 BLOCK=DP_REDUCE_BLOCK, num_warps=4))


@functools.lru_cache(maxsize=1024)
def _out_launch(kernel, cfg, B, T, H, G, D, m, Dv, NT, sq, sk, sv, norm, varlen, tmajor):
    return fast(kernel).bind(
        (NT * (cfg.BT // cfg.out_rows), cdiv(Dv, cfg.BV_out), B * H), T=T, H=H, G=G, D=D, M=m,
        DV=Dv, NT=NT, sqb=sq[0], sqt=sq[1], sqh=sq[2], skb=sk[0], skt=sk[1], skh=sk[2],
        svb=sv[0], svt=sv[1], svh=sv[2], BT=cfg.BT, RB=cfg.out_rows, BD=cfg.BD, BDT=cfg.BDT,
        BM=cfg.BM, BV=cfg.BV_out, NORM=norm, PREC=cfg.PREC, VARLEN=varlen, B=B, TMAJOR=tmajor,
        num_warps=cfg.out_warps, num_stages=cfg.stages)


@functools.lru_cache(maxsize=1024)
def _block_launch(kernel, cfg, B, T, H, G, D, m, Dv, NT, strides, norm, side, varlen, dz,
                  tmajor):
    (sqb, sqt, sqh), (skb, skt, skh), (svb, svt, svh) = strides
    rows = cfg.bwd_rows
    return fast(kernel).bind(
        (NT * (cfg.BT // rows), B * H), T=T, H=H, G=G, D=D, M=m, DV=Dv, NT=NT, sqb=sqb,
        sqt=sqt, sqh=sqh, skb=skb, skt=skt, skh=skh, svb=svb, svt=svt, svh=svh, BT=cfg.BT,
        RB=rows, BD=cfg.BD, BDT=cfg.BDT, BM=cfg.BM, BV=cfg.BV_bwd, NV=cdiv(Dv, cfg.BV_bwd),
        NORM=norm, PREC=cfg.PREC, SIDE=side, VARLEN=varlen, DZ=dz, B=B, TMAJOR=tmajor,
        num_warps=cfg.bwd_warps, num_stages=cfg.stages)


class ASAChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p_q, p_k, normalize: str, s0: Optional[torch.Tensor],
                z0: Optional[torch.Tensor], output_final_state: bool,
                seq_bounds: Optional[list] = None, tokens_before: Optional[int] = None):
        """s0, z0: the initial state (fp32) or Nones; their gradients are returned when asked
        for. The final state's two outputs are differentiable. ``tokens_before``: "mean"'s count
        of earlier tokens as a host int (no gradient); None: Σ_m z0 (z0 gets its gradient)."""
        ctx.set_materialize_grads(False)  # unused outputs: None, not zeros (no extra work)
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        p_q, p_k = p_q.contiguous(), p_k.contiguous()
        B, T, H, D = q.shape
        G = H // k.shape[2]
        Dv, m = v.shape[3], p_q.shape[2]
        cfg = launch_config(D, m, Dv, q.dtype)
        norm = NORM_CODES[normalize]
        chunks = None if seq_bounds is None else chunk_table(seq_bounds, cfg.BT, q.device)
        if s0 is not None:
            s0, z0 = s0.contiguous(), z0.contiguous()
        if norm != 2:
            seen = None  # only "mean" reads the count of earlier tokens
        elif tokens_before is not None:
            seen = torch.full((B * H,), float(tokens_before), dtype=torch.float32,
                              device=q.device)
        elif s0 is not None:
            seen = z0.sum(dim=-1).reshape(B * H).contiguous()  # tokens before (each k' sums to 1)
        else:
            seen = torch.zeros(B * H, dtype=torch.float32, device=q.device)
        states, zs, final = _chunk_states(k, v, p_k, s0, z0, cfg, H, G, output_final_state,
                                          chunks)
        NT = states.shape[2]
        tmajor = _token_major(q)  # o (and later the gradients) in q's [s, b] memory order
        o = _empty_rows(B, T, H, Dv, q.dtype, q.device, tmajor)
        den = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        _out_launch(asa_fwd_out_kernel, cfg, B, T, H, G, D, m, Dv, NT, q.stride()[:3],
                    k.stride()[:3], v.stride()[:3], norm, chunks is not None, tmajor)(
            q_ptr=q, k_ptr=k, v_ptr=v, pq_ptr=p_q, pk_ptr=p_k, states_ptr=states, zs_ptr=zs,
            seen_ptr=den if seen is None else seen, o_ptr=o, den_ptr=den,
            chunks_ptr=chunks if chunks is not None else den)
        kept = (states, zs) if cfg.keep_states else (None, None)
        ctx.save_for_backward(q, k, v, p_q, p_k, o, den, s0, z0, chunks, *kept)
        ctx.cfg, ctx.norm = cfg, norm
        ctx.count_from_z0 = norm == 2 and tokens_before is None
        if final is None:
            return o, None, None
        return o, final[0], final[1]

    @staticmethod
    def backward(ctx, d_o, d_s_final, d_z_final):
        q, k, v, p_q, p_k, o, den, s0, z0, chunks, states, zs = ctx.saved_tensors
        cfg, norm = ctx.cfg, ctx.norm
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        Dv, m = v.shape[3], p_q.shape[2]
        # the final state's gradient (None: unused) starts the reverse sums; the initial
        # state's gradient is where they end
        init = None
        if d_s_final is not None or d_z_final is not None:
            f32 = dict(dtype=torch.float32, device=q.device)
            init = (torch.zeros(B, H, m, Dv, **f32) if d_s_final is None
                    else d_s_final.to(torch.float32).contiguous(),
                    torch.zeros(B, H, m, **f32) if d_z_final is None
                    else d_z_final.to(torch.float32).contiguous())
        want_state = s0 is not None and any(ctx.needs_input_grad[6:8])
        # dO in o's layout (dense: the kernels index o's rows); zeros_like keeps the layout
        d_o = torch.zeros_like(o) if d_o is None else _like_rows(d_o, o)
        tmajor = _token_major(o)
        if states is None:  # not kept by the forward (cfg keep_states): recomputed
            states, zs, _ = _chunk_states(k, v, p_k, s0, z0, cfg, H, G, False, chunks)
        NT = states.shape[2]
        fuse_r = _fuse_r(cfg, norm, Dv, chunks)
        if fuse_r:  # written by the delta kernel of _reverse_states
            r = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        elif norm == 0 and cfg.r_kernel:
            r = _linear_r(d_o, o, den, cfg)
        elif norm == 0:  # linear: d den_i = -(dO_i·o_i) / den_i
            r = -(d_o.float() * o.float()).sum(dim=-1).transpose(1, 2) / den
            r = r.contiguous()
        else:
            r = den  # unused by the kernels
        dstates, dzs, d_state = _reverse_states(q, p_q, d_o, den, r, cfg, norm, NT, chunks,
                                                init, want_state, o if fuse_r else None)
        # dk, dv per query head; summed over the GQA group below (fp32 when there is a sum)
        kv_grad_dtype = torch.float32 if G > 1 else k.dtype
        # in o's layout: the transposes and the QKV split's backward take them as they are
        dq = _empty_rows(B, T, H, D, q.dtype, q.device, tmajor)
        dk_h = _empty_rows(B, T, H, D, kv_grad_dtype, q.device, tmajor)
        dv_h = _empty_rows(B, T, H, Dv, kv_grad_dtype, q.device, tmajor)
        # dℓ (the feature logits' gradients) stay in HBM until dP: fp32, or the inputs' dtype
        dl_dtype = q.dtype if cfg.dl_half else torch.float32
        dlq = torch.empty(B, T, H, m, dtype=dl_dtype, device=q.device)
        dlk = torch.empty(B, T, H, m, dtype=dl_dtype, device=q.device)
        strides = (q.stride()[:3], k.stride()[:3], v.stride()[:3])
        for side, dx, dl in ((0, dq, dlq), (1, dk_h, dlk)):  # query side, key side
            _block_launch(asa_bwd_block_kernel, cfg, B, T, H, G, D, m, Dv, NT, strides, norm,
                          side, chunks is not None, init is not None, tmajor)(
                q_ptr=q, k_ptr=k, v_ptr=v, pq_ptr=p_q, pk_ptr=p_k, do_ptr=d_o, den_ptr=den,
                r_ptr=r, states_ptr=states, zs_ptr=zs, dstates_ptr=dstates, dzs_ptr=dzs,
                dx_ptr=dx, dv_ptr=dv_h, dl_ptr=dl,
                chunks_ptr=chunks if chunks is not None else den)
        if G > 1:
            dk = _empty_rows(B, T, H_kv, D, k.dtype, q.device, tmajor)
            dv = _empty_rows(B, T, H_kv, Dv, v.dtype, q.device, tmajor)
            dk.copy_(dk_h.view(B, T, H_kv, G, D).sum(dim=3))  # the sum in fp32, then rounded
            dv.copy_(dv_h.view(B, T, H_kv, G, Dv).sum(dim=3))
        else:
            dk, dv = dk_h, dv_h
        dp_q, dp_k = _param_grads(q, k, dlq, dlk, G, cfg, p_q.dtype)
        d_s0 = d_z0 = None
        if want_state:
            d_s0, d_z0 = d_state
            if ctx.count_from_z0:  # "mean": seen = Σ_m z0, d seen = Σ_t -(dO·o)/den = Σ_t r
                d_z0 = d_z0 + _linear_r(d_o, o, den, cfg).sum(dim=-1, keepdim=True)
            d_s0 = d_s0 if ctx.needs_input_grad[6] else None
            d_z0 = d_z0 if ctx.needs_input_grad[7] else None
        return dq, dk, dv, dp_q, dp_k, None, d_s0, d_z0, None, None, None


def asa_attention_kernel(q, k, v, p_q, p_k, normalize: str = "linear", initial_state=None,
                         output_final_state: bool = False,
                         cu_seqlens: Optional[torch.Tensor] = None,
                         seq_bounds: Optional[list] = None,
                         tokens_before: Optional[int] = None):
    """Causal ASA through the Triton kernels. Shapes as ``ops.asa_attention`` (checked there).

    Returns o ``[B, T, H, Dv]`` (q.dtype), or ``(o, ASAState(S, z))`` when
    ``output_final_state``; ``initial_state`` is an ``ASAState`` (fp32) or None. ``cu_seqlens``
    (B = 1, ``[0, end_1, ..., T]``): packed sequences, each with its own fresh state (not
    combinable with initial/final states, which belong to one sequence). ``seq_bounds``: the
    list ``checks.check_cu_seqlens`` returned for it, which ``ops.asa_attention`` hands over so
    that a call syncs with the host once; without it the boundaries are checked (and read) here.
    Autograd runs through the states both ways: ``initial_state``'s S and z get their gradient
    and the returned state's are differentiable (context parallelism's state passing).
    ``tokens_before`` ("mean" with an initial state): the count of earlier tokens as a host int
    (exact, no gradient); None: Σ_m z of the initial state (as decode counts).
    """
    if q.is_cuda and not kernel_supports(q.shape[3], p_q.shape[2], v.shape[3]):
        raise ValueError(
            f"asa_attention_kernel: head dim D={q.shape[3]}, rank m={p_q.shape[2]}, value dim "
            f"Dv={v.shape[3]} are outside the GPU-verified sizes (32 < D, Dv <= 512, 16 < m <= "
            "256, m <= 128 when D or Dv > 128); use impl='reference' or impl=None")
    if normalize not in NORM_CODES:
        raise ValueError(f"asa_attention_kernel: normalize={normalize!r} is not one of "
                         f"{tuple(NORM_CODES)}")
    B, T, H, _ = q.shape
    m, Dv = p_q.shape[2], v.shape[3]
    check_int32_offsets("asa_attention_kernel", q=q.numel(), k=k.numel(), v=v.numel(),
                        output=B * T * H * Dv, feature_grads=B * T * H * m,
                        chunk_states=B * H * cdiv(T, 64) * m * Dv)
    if cu_seqlens is not None:
        if initial_state is not None or output_final_state:
            raise ValueError("asa_attention_kernel: cu_seqlens cannot be combined with "
                             "initial_state or output_final_state (states are per sequence)")
        if seq_bounds is None:
            seq_bounds = check_cu_seqlens("asa_attention", cu_seqlens, q)
    elif seq_bounds is not None:
        raise ValueError("asa_attention_kernel: seq_bounds is given without cu_seqlens")
    s0 = z0 = None
    if initial_state is not None:
        s0, z0 = initial_state
        if s0.dtype != torch.float32 or z0.dtype != torch.float32:
            raise ValueError("asa_attention_kernel: initial_state must be float32 (S, z)")
    out_dtype = q.dtype
    if out_dtype == torch.bfloat16 and triton_interpreting():
        # Triton's interpreter computes bf16 tl.dot wrongly: there (only) run on fp32 copies;
        # autograd casts the gradients back to bf16
        q, k, v, p_q, p_k = (x.float() for x in (q, k, v, p_q, p_k))
    if tokens_before is not None and initial_state is None:
        raise ValueError("asa_attention_kernel: tokens_before is given without initial_state")
    o, s_t, z_t = ASAChunkFunction.apply(q, k, v, p_q, p_k, normalize, s0, z0,
                                         bool(output_final_state), seq_bounds,
                                         None if tokens_before is None else int(tokens_before))
    o = o.to(out_dtype)
    if output_final_state:
        return o, ASAState(s_t, z_t)
    return o
