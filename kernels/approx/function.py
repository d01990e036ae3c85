"""``ApproxChunkFunction``: the Triton kernels of ``chunk.py`` as one autograd Function.

Layout ``[B, T, H, D]`` (k, v: ``[B, T, H_kv, D]``, GQA); the math and conventions are those of
``megatron_subq.ops.approx`` (the d_h^{-1/4} pre-scaling applied here; tests compare against it).
Gradients flow to q, k and v; an initial state is an input without gradient and the final state
an output without gradient (for prefill/decode, not for training through states).
"""

from __future__ import annotations

import json
import os

import torch
import triton

from megatron_subq.ops.dispatch import triton_interpreting

from ..common import check_chunk_kernel_inputs, check_int32_offsets

from .chunk import (
    approx_bwd_dk_kernel,
    approx_bwd_dq_kernel,
    approx_bwd_dv_kernel,
    approx_bwd_prep_kernel,
    approx_bwd_states_kernel,
    approx_fwd_out_kernel,
    approx_fwd_states_kernel,
)

CHUNK = 64  # tokens per chunk: the intra-chunk products are BT x BT tensor-core tiles
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # at 256 the fp32 output kernel needs ~290 KB of shared memory (H100: 228 KB)
LAUNCH_ENV = "MEGATRON_SUBQ_APPROX_LAUNCH"  # JSON overrides of the launch config (benchmark sweeps)


def kernel_supports(D: int) -> bool:
    """Whether the compiled (GPU) kernels are verified for head dim ``D``.

    Verified on an H100 (tests/test_approx_kernel.py, Triton 3.6, 2026-11-22): D = 96 and 128 in
    fp32/fp16/bf16. A D = 64 fp32 case failed to launch there ("Triton Error [CUDA]: out of
    memory", i.e. its launch resources) and was not investigated, so ``impl=None`` on CUDA uses the
    reference outside 64 < D <= 128. The interpreter (CPU) runs every size.
    """
    return 64 < D <= MAX_HEAD_DIM


def _launch(D: int, dtype: torch.dtype) -> dict:
    """Fixed launch configuration (no autotuning: it must also run under TRITON_INTERPRET=1).

    One option, on by default since its GPU test and A/B (H100, 2026-11-22: fwd+bwd 3.59 →
    3.10 ms at T = 16K, H = 16, D = 128, bf16; docs/benchmarks.md):

    * keep_states: the forward saves the chunk states it computed (S1, S2 entering every chunk,
      2·B·H_kv·NT·D·D values in ``state_dtype``, plus z and sv, 3·B·H_kv·NT·D fp32 values) for
      the backward, which otherwise reruns the sequential state scan (~500 us of the 3.6 ms
      fwd + bwd at that size) — memory traded for time. S1, S2 are
      D / (BT·G) times the size of o1, o2, which the forward saves anyway: at H_kv = 16,
      D = 128, T = 16K in bf16, 268 MB per layer.

    ``$MEGATRON_SUBQ_APPROX_LAUNCH`` (JSON) overrides any key, read on every call.
    """
    BD = max(16, triton.next_power_of_2(D))
    cfg = dict(
        BT=CHUNK, BD=BD,
        # S blocks of the state scans, one program each: 2 x 4 blocks per head at D = 128
        BK_state=min(64, BD), BV_state=min(32, BD),
        BV_out=min(64, BD),
        PREC="ieee" if dtype == torch.float32 else "tf32",  # ignored for 16-bit operands
        DOT_F32=dtype == torch.bfloat16 and triton_interpreting(),
        state_dtype=torch.float32 if dtype == torch.float32 else dtype,
        warps=4 if BD <= 64 else 8,
        keep_states=True,
    )
    overrides = os.environ.get(LAUNCH_ENV)
    if overrides:
        cfg.update(json.loads(overrides))
    return cfg


def _forward_states(k, v, state, cfg, store_final: bool):
    """Run the state scan: S1, S2 (cfg's state dtype), z (fp32 [.., 2, D]) and sv (fp32) entering
    every chunk, and the final fp32 state (s1, s2, z1, z2, sv) if asked."""
    B, T, H_kv, D = k.shape
    NT = triton.cdiv(T, cfg["BT"])
    dev = k.device
    s1 = torch.empty(B, H_kv, NT, D, D, dtype=cfg["state_dtype"], device=dev)
    s2 = torch.empty_like(s1)
    z = torch.empty(B, H_kv, NT, 2, D, dtype=torch.float32, device=dev)
    sv = torch.empty(B, H_kv, NT, D, dtype=torch.float32, device=dev)
    if store_final:
        final = (torch.empty(B, H_kv, D, D, dtype=torch.float32, device=dev),
                 torch.empty(B, H_kv, D, D, dtype=torch.float32, device=dev),
                 *(torch.empty(B, H_kv, D, dtype=torch.float32, device=dev) for _ in range(3)))
    else:
        final = (s1, s2, z, z, sv)  # never written (STORE_FINAL=False)
    initial = state if state is not None else (s1, s2, z, z, sv)  # never read without a state
    grid = (triton.cdiv(D, cfg["BK_state"]), triton.cdiv(D, cfg["BV_state"]), B * H_kv)
    approx_fwd_states_kernel[grid](
        k, v, *initial, s1, s2, z, sv, *final, T, H_kv, D, NT, D ** -0.25,
        BT=cfg["BT"], BK=cfg["BK_state"], BV=cfg["BV_state"], HAS_STATE=state is not None,
        STORE_FINAL=store_final, PREC=cfg["PREC"], DOT_F32=cfg["DOT_F32"], num_warps=4)
    return s1, s2, z, sv, (final if store_final else None)


class ApproxChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, eps: float, length0: int, s1_0, s2_0, z1_0, z2_0, sv_0,
                output_final_state: bool):
        q, k, v = (x.contiguous() for x in (q, k, v))
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        cfg = _launch(D, q.dtype)
        state = None if s1_0 is None else (s1_0, s2_0, z1_0, z2_0, sv_0)
        s1, s2, z, sv, final = _forward_states(k, v, state, cfg, bool(output_final_state))
        NT = s1.shape[2]
        o = torch.empty_like(q)
        o1 = torch.empty(B, T, H, D, dtype=cfg["state_dtype"], device=q.device)
        o2 = torch.empty_like(o1)
        den = torch.empty(B, H, 2, T, dtype=torch.float32, device=q.device)
        approx_fwd_out_kernel[(triton.cdiv(D, cfg["BV_out"]), NT, B * H)](
            q, k, v, s1, s2, z, sv, o, o1, o2, den,
            T, H, H_kv, G, D, NT, length0, D ** -0.25, eps,
            BT=cfg["BT"], BD=cfg["BD"], BV=cfg["BV_out"], PREC=cfg["PREC"],
            DOT_F32=cfg["DOT_F32"], num_warps=cfg["warps"])
        kept = (s1, s2, z, sv) if cfg["keep_states"] else (None,) * 4
        ctx.save_for_backward(q, k, v, o1, o2, den, s1_0, s2_0, z1_0, z2_0, sv_0, *kept)
        ctx.cfg, ctx.eps, ctx.length0 = cfg, eps, length0
        if final is None:
            return o, None, None, None, None, None
        ctx.mark_non_differentiable(*final)
        return (o, *final)

    @staticmethod
    def backward(ctx, d_o, *_d_final):
        q, k, v, o1, o2, den, s1_0, s2_0, z1_0, z2_0, sv_0, s1, s2, z, sv = ctx.saved_tensors
        cfg, eps, length0 = ctx.cfg, ctx.eps, ctx.length0
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        d_o = d_o.contiguous()
        if s1 is None:  # not kept by the forward (cfg keep_states): recomputed
            state = None if s1_0 is None else (s1_0, s2_0, z1_0, z2_0, sv_0)
            s1, s2, z, sv, _ = _forward_states(k, v, state, cfg, False)
        NT = s1.shape[2]
        scale = D ** -0.25
        r = torch.empty_like(den)
        approx_bwd_prep_kernel[(NT, B * H)](
            d_o, o1, o2, den, r, T, H, D, eps, BT=cfg["BT"], BD=cfg["BD"],
            num_warps=cfg["warps"])
        ds1, ds2, dz, dsv = (torch.empty_like(x) for x in (s1, s2, z, sv))
        grid = (triton.cdiv(D, cfg["BK_state"]), triton.cdiv(D, cfg["BV_state"]), B * H_kv)
        approx_bwd_states_kernel[grid](
            q, d_o, den, r, ds1, ds2, dz, dsv, T, H, H_kv, G, D, NT, length0, scale, eps,
            BT=cfg["BT"], BK=cfg["BK_state"], BV=cfg["BV_state"], PREC=cfg["PREC"],
            DOT_F32=cfg["DOT_F32"], num_warps=8)  # 4 warps: ptxas spills ~400 B per thread
        # dk, dv per query head, summed over the GQA group below (fp32 when there is a sum)
        kv_grad_dtype = torch.float32 if G > 1 else k.dtype
        dq = torch.empty_like(q)
        dk_h = torch.empty(B, T, H, D, dtype=kv_grad_dtype, device=q.device)
        dv_h = torch.empty(B, T, H, D, dtype=kv_grad_dtype, device=q.device)
        common = dict(BT=cfg["BT"], BD=cfg["BD"], BV=cfg["BV_out"], PREC=cfg["PREC"],
                      DOT_F32=cfg["DOT_F32"], num_warps=cfg["warps"])
        approx_bwd_dq_kernel[(NT, B * H)](
            q, k, v, d_o, den, r, s1, s2, z, dq, T, H, H_kv, G, D, NT, scale, eps, **common)
        approx_bwd_dk_kernel[(NT, B * H)](
            q, k, v, d_o, den, r, ds1, ds2, dz, dk_h, T, H, H_kv, G, D, NT, scale, eps, **common)
        approx_bwd_dv_kernel[(triton.cdiv(D, cfg["BV_out"]), NT, B * H)](
            q, k, d_o, den, ds1, ds2, dsv, dv_h, T, H, H_kv, G, D, NT, length0, scale, eps,
            BT=cfg["BT"], BD=cfg["BD"], BV=cfg["BV_out"], PREC=cfg["PREC"],
            DOT_F32=cfg["DOT_F32"], num_warps=cfg["warps"])
        if G > 1:
            dk = dk_h.view(B, T, H_kv, G, D).sum(dim=3).to(k.dtype)
            dv = dv_h.view(B, T, H_kv, G, D).sum(dim=3).to(v.dtype)
        else:
            dk, dv = dk_h, dv_h
        return dq, dk, dv, None, None, None, None, None, None, None, None


def approx_attention_kernel(q, k, v, eps: float = 1e-6, state=None,
                            output_final_state: bool = False):
    """Causal approx attention through the Triton kernels (what ``ops.approx_attention``
    dispatches to). q: [B, T, H, D] raw query projection; k, v: [B, T, H_kv, D] raw projections.

    ``state``: an ``ApproxState`` to continue from (not modified; any float dtype, used in fp32).
    Returns o ``[B, T, H, D]`` in q.dtype, or ``(o, ApproxState)`` after the T tokens when
    ``output_final_state`` — in the given state's dtype, else fp32, as the reference does.
    """
    from megatron_subq.ops.approx import ApproxState, _check_eps, _check_state  # noqa: PLC0415

    op = "approx_attention_kernel"
    B, T, H, H_kv, D = check_chunk_kernel_inputs(op, q, k, v, SUPPORTED_DTYPES)
    _check_eps(op, eps)
    if D > MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim {D} is above the kernel's {MAX_HEAD_DIM} (its [64, D] "
                         "tiles and D x D state blocks outgrow shared memory); use "
                         "impl='reference'")
    check_int32_offsets(op, q=q.numel(), k=k.numel(),
                        chunk_states=B * H_kv * triton.cdiv(T, CHUNK) * D * D)
    tensors0 = (None,) * 5
    length0 = 0
    if state is not None:
        _check_state(op, state, B, H_kv, D)
        # kernel argument order: kv1, kv2, sum_k1, sum_k2, sum_v
        tensors0 = tuple(t.detach().to(torch.float32).contiguous()
                         for t in (state.kv1, state.kv2, state.sum_k1, state.sum_k2, state.sum_v))
        length0 = state.length
    o, *final = ApproxChunkFunction.apply(q, k, v, float(eps), int(length0), *tensors0,
                                          bool(output_final_state))
    if not output_final_state:
        return o
    dtype = state.sum_v.dtype if state is not None else torch.float32
    kv1, kv2, sum_k1, sum_k2, sum_v = (t.to(dtype) for t in final)
    return o, ApproxState(sum_v, sum_k1, sum_k2, kv1, kv2, length0 + T)
