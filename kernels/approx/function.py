"""``ApproxChunkFunction``: the Triton kernels of ``chunk.py`` as one autograd Function.

Layout ``[B, T, H, D]`` (k, v: ``[B, T, H_kv, D]``, GQA); the math and conventions are those of
``megatron_subq.ops.approx`` (the d_h^{-1/4} pre-scaling applied here; tests compare against it).
Gradients flow to q, k and v, and through the states: the initial state (fp32) gets its exact
gradient and the final state's gradient flows back into q, k, v and the initial state (context
parallelism's state passing trains through them). Without a state and without a gradient on the
final state the backward does exactly what it did before (no extra work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..checks import triton_interpreting
from ..common import (
    cached_config,
    check_chunk_kernel_inputs,
    check_int32_offsets,
    env_overrides,
)
from ..scan import scan_pair as _scan_pair
from .chunk import (
    approx_bwd_delta_kernel,
    approx_bwd_dk_kernel,
    approx_bwd_dq_kernel,
    approx_bwd_dv_kernel,
    approx_bwd_prep_kernel,
    approx_bwd_states_kernel,
    approx_fwd_delta_kernel,
    approx_fwd_out_kernel,
    approx_fwd_states_kernel,
)
from .state import ApproxState, check_eps, check_state

# tokens per chunk (BT): the intra-chunk products are BT x BT tensor-core tiles, and the chunk
# states (two D x D per chunk) shrink with longer chunks: 128 for 16-bit inputs; fp32 inputs keep
# 64, whose fp32 tiles at 128 need twice the registers and shared memory
CHUNK = 64
CHUNK_HALF = 128
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # at 256 the fp32 output kernel needs more shared memory than a GPU has
LAUNCH_ENV = "MEGATRON_SUBQ_APPROX_LAUNCH"  # JSON overrides of the launch config (benchmark sweeps)


def kernel_supports(D: int) -> bool:
    """Whether the compiled (GPU) kernels are verified for head dim ``D``.

    Verified by the GPU tests (tests/test_approx_kernel.py): D = 96 and 128 in fp32/fp16/bf16.
    A D = 64 fp32 case failed to launch there (its launch resources), so ``impl=None`` on CUDA
    uses the reference outside 64 < D <= 128. The interpreter (CPU) runs every size.
    """
    return 64 < D <= MAX_HEAD_DIM


@dataclass(frozen=True)
class LaunchConfig:
    """approx's fixed launch configuration (no autotuning: it must also run under
    TRITON_INTERPRET=1).

    Tiles: BT tokens per chunk, BD the padded head dim, BK_state x BV_state the S blocks of the
    sequential state scans (one program each), BV_out the output kernel's V block, warps per
    kernel; PREC the dots' precision (ignored for 16-bit operands); DOT_F32 (bf16 under the
    interpreter only) runs the dots on fp32 copies. state_dtype: the stored chunk states S (and
    dS) in the inputs' dtype (the dots round them to it anyway), fp32 for fp32 inputs; every
    running sum and the final state are fp32.
    keep_states (on): the forward saves its chunk states for the backward instead of recomputing
    them (memory for time).
    scan: "parallel" (default; a delta kernel parallel over all chunks, BK_delta x BV_delta
    blocks of dS1, dS2 with delta_warps, delta_stages, then the streaming prefix sum shared with
    ASA, scan_block values per program, scan_unroll chunks per step, scan_warps, scan_stages;
    memory-bound) or "sequential" (one program per S block walks the chunks in order;
    latency-bound, fewer bytes).
    deltas_half (on for bf16 inputs): the parallel scan's per-chunk deltas in bf16 (summed in
    fp32); fp32 and fp16 inputs keep fp32 deltas (fp16's range)."""
    BT: int
    BD: int
    BK_state: int
    BV_state: int
    BV_out: int
    PREC: str
    DOT_F32: bool
    state_dtype: torch.dtype
    warps: int
    keep_states: bool
    scan: str
    BK_delta: int
    BV_delta: int
    delta_warps: int
    delta_stages: int
    deltas_half: bool
    scan_block: int
    scan_unroll: int
    scan_warps: int
    scan_stages: int


@cached_config(LAUNCH_ENV)
def launch_config(D: int, dtype: torch.dtype) -> LaunchConfig:
    """The launch config for head dim D in ``dtype``, with the overrides of
    ``$MEGATRON_SUBQ_APPROX_LAUNCH`` (JSON, any field); cached per arguments and environment
    (``common.cached_config``)."""
    BD = max(16, triton.next_power_of_2(D))
    cfg = LaunchConfig(
        BT=CHUNK if dtype == torch.float32 else CHUNK_HALF, BD=BD,
        # S blocks of the sequential state scans, one program each: 2 x 4 blocks per head at 128
        BK_state=min(64, BD), BV_state=min(32, BD),
        BV_out=min(64, BD),
        PREC="ieee" if dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        DOT_F32=dtype == torch.bfloat16 and triton_interpreting(),
        state_dtype=torch.float32 if dtype == torch.float32 else dtype,
        warps=4 if BD <= 64 else 8,
        keep_states=True,
        scan="parallel",
        # the delta kernels' [BK, BV] blocks of dS1, dS2 (both in one program) and warps: at
        # D = 128, 64 x 64 and 8 warps compile without register spills; 128 x 64 spills in the
        # backward, and so do both at 4 warps
        BK_delta=min(64, BD), BV_delta=min(64, BD), delta_warps=8 if BD >= 64 else 4,
        delta_stages=3,
        deltas_half=dtype == torch.bfloat16,
        scan_block=1024, scan_unroll=8, scan_warps=4, scan_stages=1,
    )
    cfg = env_overrides(cfg, LAUNCH_ENV)
    if cfg.scan not in ("parallel", "sequential"):
        raise ValueError(f"approx launch config: scan={cfg.scan!r}; allowed 'parallel' or "
                         "'sequential'")
    return cfg


def _empty_states(B, H_kv, NT, D, dtype, dev):
    """The chunk-state tensors both scans write: S1, S2 as ``[B, H_kv, NT, 2, D, D]`` in
    ``dtype`` and z1, z2, sv (or dz1, dz2, dsv) as fp32 ``[B, H_kv, NT, 3, D]``."""
    return (torch.empty(B, H_kv, NT, 2, D, D, dtype=dtype, device=dev),
            torch.empty(B, H_kv, NT, 3, D, dtype=torch.float32, device=dev))


def _forward_states(k, v, state, cfg, store_final: bool):
    """The states entering every chunk: S (S1, S2; cfg's state dtype, ``[B, H_kv, NT, 2, D, D]``)
    and zv (z1, z2, sv; fp32 ``[B, H_kv, NT, 3, D]``), and the final fp32 state
    ``(S [B, H_kv, 2, D, D], zv [B, H_kv, 3, D])`` if asked. ``state``: None or the initial
    state packed the same way (fp32, contiguous)."""
    B, T, H_kv, D = k.shape
    NT = triton.cdiv(T, cfg.BT)
    dev = k.device
    scale = D ** -0.25
    if cfg.scan == "parallel":
        half = cfg.deltas_half and k.dtype in (torch.float16, torch.bfloat16)
        ds, dzv = _empty_states(B, H_kv, NT, D, k.dtype if half else torch.float32, dev)
        n_k, n_v = triton.cdiv(D, cfg.BK_delta), triton.cdiv(D, cfg.BV_delta)
        approx_fwd_delta_kernel[(n_k * n_v, NT, B * H_kv)](
            k_ptr=k, v_ptr=v, ds_ptr=ds, dzv_ptr=dzv, T=T, HKV=H_kv, D=D, NT=NT, NV=n_v,
            scale=scale, BT=cfg.BT, BK=cfg.BK_delta, BV=cfg.BV_delta, PREC=cfg.PREC,
            DOT_F32=cfg.DOT_F32, num_warps=cfg.delta_warps, num_stages=cfg.delta_stages)
        s0, zv0 = state if state is not None else (None, None)
        return _scan_pair(ds, dzv, s0, zv0, cfg, False, store_final, None, cfg.state_dtype)
    s, zv = _empty_states(B, H_kv, NT, D, cfg.state_dtype, dev)
    final = None
    if store_final:
        final = (torch.empty(B, H_kv, 2, D, D, dtype=torch.float32, device=dev),
                 torch.empty(B, H_kv, 3, D, dtype=torch.float32, device=dev))
    s0, zv0 = state if state is not None else (s, zv)  # never read without a state
    s_final, zv_final = final or (s, zv)  # never written without store_final
    grid = (triton.cdiv(D, cfg.BK_state), triton.cdiv(D, cfg.BV_state), B * H_kv)
    approx_fwd_states_kernel[grid](
        k_ptr=k, v_ptr=v, s0_ptr=s0, zv0_ptr=zv0, s_ptr=s, zv_ptr=zv, sf_ptr=s_final,
        zvf_ptr=zv_final, T=T, HKV=H_kv, D=D, NT=NT, scale=scale, BT=cfg.BT, BK=cfg.BK_state,
        BV=cfg.BV_state, HAS_STATE=state is not None, STORE_FINAL=store_final, PREC=cfg.PREC,
        DOT_F32=cfg.DOT_F32, num_warps=4)
    return s, zv, final


def _reverse_states(q, d_o, den, r, cfg, H_kv: int, NT: int, length0: int, eps: float,
                    init=None, store_final: bool = False):
    """The reverse states after every chunk, summed over each GQA group: dS (dS1, dS2; cfg's
    state dtype, ``[B, H_kv, NT, 2, D, D]``) and dzv (dz1, dz2, dsv; fp32
    ``[B, H_kv, NT, 3, D]``), and (store_final) the sums past the first chunk, the initial
    state's gradient ``(dS [B, H_kv, 2, D, D], dzv [B, H_kv, 3, D])`` fp32, else None.
    ``init``: None or the final state's gradient packed the same way (fp32, contiguous), where
    the reverse sums start (the final state is the initial one plus every chunk's sums)."""
    B, T, H, D = q.shape
    G, scale = H // H_kv, D ** -0.25
    if cfg.scan == "parallel":
        half = cfg.deltas_half and q.dtype in (torch.float16, torch.bfloat16)
        ds, dzv = _empty_states(B, H_kv, NT, D, q.dtype if half else torch.float32, q.device)
        n_k, n_v = triton.cdiv(D, cfg.BK_delta), triton.cdiv(D, cfg.BV_delta)
        approx_bwd_delta_kernel[(n_k * n_v, NT, B * H_kv)](
            q_ptr=q, do_ptr=d_o, den_ptr=den, r_ptr=r, ds_ptr=ds, dzv_ptr=dzv, T=T, H=H, HKV=H_kv,
            G=G, D=D, NT=NT, NV=n_v, L0=length0, scale=scale, eps=eps, BT=cfg.BT, BK=cfg.BK_delta,
            BV=cfg.BV_delta, PREC=cfg.PREC, DOT_F32=cfg.DOT_F32, num_warps=cfg.delta_warps,
            num_stages=cfg.delta_stages)
        s0, zv0 = init if init is not None else (None, None)
        return _scan_pair(ds, dzv, s0, zv0, cfg, True, store_final, None, cfg.state_dtype)
    ds, dzv = _empty_states(B, H_kv, NT, D, cfg.state_dtype, q.device)
    final = None
    if store_final:
        final = (torch.empty(B, H_kv, 2, D, D, dtype=torch.float32, device=q.device),
                 torch.empty(B, H_kv, 3, D, dtype=torch.float32, device=q.device))
    ds0, dzv0 = init if init is not None else (ds, dzv)  # never read without init
    dsf, dzvf = final or (ds, dzv)  # never written without store_final
    grid = (triton.cdiv(D, cfg.BK_state), triton.cdiv(D, cfg.BV_state), B * H_kv)
    approx_bwd_states_kernel[grid](
        q_ptr=q, do_ptr=d_o, den_ptr=den, r_ptr=r, ds_ptr=ds, dzv_ptr=dzv, ds0_ptr=ds0,
        dzv0_ptr=dzv0, dsf_ptr=dsf, dzvf_ptr=dzvf, T=T, H=H, HKV=H_kv, G=G,
        D=D, NT=NT, L0=length0, scale=scale, eps=eps, BT=cfg.BT, BK=cfg.BK_state, BV=cfg.BV_state,
        PREC=cfg.PREC, DOT_F32=cfg.DOT_F32, HAS_INIT=init is not None, STORE_FINAL=store_final,
        num_warps=8)  # 4 warps: ptxas spills ~400 B per thread
    return ds, dzv, final


class ApproxChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, eps: float, length0: int, s1_0, s2_0, z1_0, z2_0, sv_0,
                output_final_state: bool, cfg: dict):
        """cfg: ``launch_config(D, q.dtype)``, read once per call by ``approx_attention_kernel``.
        s1_0, s2_0, z1_0, z2_0, sv_0: the initial state (kv1, kv2, sum_k1, sum_k2, sum_v; fp32)
        or Nones; their gradients are returned when asked for. The final state's five outputs
        are differentiable."""
        ctx.set_materialize_grads(False)  # unused outputs: None, not zeros (no extra work)
        q, k, v = (x.contiguous() for x in (q, k, v))
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        state = None
        if s1_0 is not None:  # packed as the scans' initial sums: [B, H_kv, 2, D, D], [.., 3, D]
            state = (torch.stack((s1_0, s2_0), dim=2).float().contiguous(),
                     torch.stack((z1_0, z2_0, sv_0), dim=2).float().contiguous())
        s, zv, final = _forward_states(k, v, state, cfg, bool(output_final_state))
        NT = s.shape[2]
        o = torch.empty_like(q)
        o1 = torch.empty(B, T, H, D, dtype=cfg.state_dtype, device=q.device)
        o2 = torch.empty_like(o1)
        den = torch.empty(B, H, 2, T, dtype=torch.float32, device=q.device)
        approx_fwd_out_kernel[(triton.cdiv(D, cfg.BV_out), NT, B * H)](
            q_ptr=q, k_ptr=k, v_ptr=v, s_ptr=s, zv_ptr=zv, o_ptr=o, o1_ptr=o1, o2_ptr=o2,
            den_ptr=den, T=T, H=H, HKV=H_kv, G=G, D=D, NT=NT, L0=length0, scale=D ** -0.25, eps=eps,
            BT=cfg.BT, BD=cfg.BD, BV=cfg.BV_out, PREC=cfg.PREC, DOT_F32=cfg.DOT_F32,
            num_warps=cfg.warps)
        kept = (s, zv) if cfg.keep_states else (None, None)
        initial = state if state is not None else (None, None)
        ctx.save_for_backward(q, k, v, o1, o2, den, *initial, *kept)
        ctx.cfg, ctx.eps, ctx.length0 = cfg, eps, length0
        if final is None:
            return o, None, None, None, None, None
        # (kv1, kv2, sum_k1, sum_k2, sum_v), each its own contiguous tensor (not views of one
        # buffer: a decode step updates them in place)
        final = tuple(t.clone(memory_format=torch.contiguous_format)
                      for t in (*final[0].unbind(dim=2), *final[1].unbind(dim=2)))
        return (o, *final)

    @staticmethod
    def backward(ctx, d_o, *d_final):
        q, k, v, o1, o2, den, s0, zv0, s, zv = ctx.saved_tensors
        cfg, eps, length0 = ctx.cfg, ctx.eps, ctx.length0
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        # the final state's gradient (kv1, kv2, sum_k1, sum_k2, sum_v; None: unused) starts the
        # reverse sums; the initial state's gradient is where they end
        init = _pack_state_grad(d_final, q, H_kv, D)
        want_state = s0 is not None and any(ctx.needs_input_grad[5:10])
        d_o = torch.zeros_like(q) if d_o is None else d_o.contiguous()
        if s is None:  # not kept by the forward (cfg keep_states): recomputed
            state = None if s0 is None else (s0, zv0)
            s, zv, _ = _forward_states(k, v, state, cfg, False)
        NT = s.shape[2]
        scale = D ** -0.25
        r = torch.empty_like(den)
        approx_bwd_prep_kernel[(NT, B * H)](
            do_ptr=d_o, o1_ptr=o1, o2_ptr=o2, den_ptr=den, r_ptr=r, T=T, H=H, D=D, eps=eps,
            BT=cfg.BT, BD=cfg.BD, num_warps=cfg.warps)
        ds, dzv, d_state = _reverse_states(q, d_o, den, r, cfg, H_kv, NT, length0, eps, init,
                                           want_state)
        # dk, dv per query head, summed over the GQA group below (fp32 when there is a sum)
        kv_grad_dtype = torch.float32 if G > 1 else k.dtype
        dq = torch.empty_like(q)
        dk_h = torch.empty(B, T, H, D, dtype=kv_grad_dtype, device=q.device)
        dv_h = torch.empty(B, T, H, D, dtype=kv_grad_dtype, device=q.device)
        common = dict(BT=cfg.BT, BD=cfg.BD, BV=cfg.BV_out, PREC=cfg.PREC,
                      DOT_F32=cfg.DOT_F32, num_warps=cfg.warps)
        approx_bwd_dq_kernel[(NT, B * H)](
            q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=d_o, den_ptr=den, r_ptr=r, s_ptr=s, zv_ptr=zv,
            dq_ptr=dq, T=T, H=H, HKV=H_kv, G=G, D=D, NT=NT, scale=scale, eps=eps, **common)
        approx_bwd_dk_kernel[(NT, B * H)](
            q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=d_o, den_ptr=den, r_ptr=r, ds_ptr=ds, dzv_ptr=dzv,
            dk_ptr=dk_h, T=T, H=H, HKV=H_kv, G=G, D=D, NT=NT, scale=scale, eps=eps, **common)
        approx_bwd_dv_kernel[(triton.cdiv(D, cfg.BV_out), NT, B * H)](
            q_ptr=q, k_ptr=k, do_ptr=d_o, den_ptr=den, ds_ptr=ds, dzv_ptr=dzv, dv_ptr=dv_h, T=T,
            H=H, HKV=H_kv, G=G, D=D, NT=NT, L0=length0, scale=scale, eps=eps, BT=cfg.BT, BD=cfg.BD,
            BV=cfg.BV_out, PREC=cfg.PREC, DOT_F32=cfg.DOT_F32, num_warps=cfg.warps)
        if G > 1:
            dk = dk_h.view(B, T, H_kv, G, D).sum(dim=3).to(k.dtype)
            dv = dv_h.view(B, T, H_kv, G, D).sum(dim=3).to(v.dtype)
        else:
            dk, dv = dk_h, dv_h
        d0 = (None,) * 5
        if d_state is not None:  # kv1, kv2, sum_k1, sum_k2, sum_v
            d0 = (*d_state[0].unbind(dim=2), *d_state[1].unbind(dim=2))
        return (dq, dk, dv, None, None, *d0, None, None)


def _pack_state_grad(d_final, q, H_kv: int, D: int):
    """The final state's gradients (kv1, kv2, sum_k1, sum_k2, sum_v; None for those without)
    packed as the reverse scans' start: fp32 ``([B, H_kv, 2, D, D], [B, H_kv, 3, D])``, or None
    when none has a gradient."""
    if not d_final or all(g is None for g in d_final):
        return None
    B = q.shape[0]
    f32 = dict(dtype=torch.float32, device=q.device)

    def pick(g, *shape):
        return torch.zeros(B, H_kv, *shape, **f32) if g is None else g.to(torch.float32)

    s = torch.stack([pick(g, D, D) for g in d_final[:2]], dim=2).contiguous()
    zv = torch.stack([pick(g, D) for g in d_final[2:]], dim=2).contiguous()
    return s, zv


def approx_attention_kernel(q, k, v, eps: float = 1e-6, state=None,
                            output_final_state: bool = False):
    """Causal approx attention through the Triton kernels (what ``ops.approx_attention``
    dispatches to). q: [B, T, H, D] raw query projection; k, v: [B, T, H_kv, D] raw projections.

    ``state``: an ``ApproxState`` to continue from (not modified; any float dtype, used in fp32).
    Returns o ``[B, T, H, D]`` in q.dtype, or ``(o, ApproxState)`` after the T tokens when
    ``output_final_state`` — in the given state's dtype, else fp32, as the reference does.
    Autograd runs through the state both ways: ``state``'s tensors get their gradient (through
    the fp32 copy) and the returned state's tensors are differentiable (context parallelism's
    state passing; ``state.length`` is a count, an int or a 0-dim tensor, without gradient).
    """
    op = "approx_attention_kernel"
    B, T, H, H_kv, D = check_chunk_kernel_inputs(op, q, k, v, SUPPORTED_DTYPES)
    check_eps(op, eps)
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim {D} is above the kernel's {MAX_HEAD_DIM} (its [64, D] "
                         "tiles and D x D state blocks outgrow shared memory); use "
                         "impl='reference'")
    cfg = launch_config(D, q.dtype)
    check_int32_offsets(op, q=q.numel(), k=k.numel(),
                        chunk_states=2 * B * H_kv * triton.cdiv(T, cfg.BT) * D * D)
    tensors0 = (None,) * 5
    length0 = 0
    if state is not None:
        check_state(op, state, B, H_kv, D)
        # kernel argument order: kv1, kv2, sum_k1, sum_k2, sum_v
        tensors0 = tuple(t.to(torch.float32).contiguous()
                         for t in (state.kv1, state.kv2, state.sum_k1, state.sum_k2, state.sum_v))
        length0 = int(state.length)  # a host int (state passing, decode); a 0-dim tensor syncs
    o, *final = ApproxChunkFunction.apply(q, k, v, float(eps), int(length0), *tensors0,
                                          bool(output_final_state), cfg)
    if not output_final_state:
        return o
    dtype = state.sum_v.dtype if state is not None else torch.float32
    kv1, kv2, sum_k1, sum_k2, sum_v = (t.to(dtype) for t in final)
    return o, ApproxState(sum_v, sum_k1, sum_k2, kv1, kv2, length0 + T)
