"""``PPAFunction``: the Triton kernels of ``kernels.py`` as one autograd Function, and its plan.

Layout ``[B, T, H, D]`` (k, v: ``[B, T, H_kv, D]``, GQA); the math is ``megatron_subq.ops.ppa``'s
(which the tests compare against). The host builds an ``OffsetPlan`` once per (p, w, T, device):

* the dense reach R: the window w, extended over the power offsets as long as each lies at most
  ``dense_gap`` past the previous one (where the diagonals are that close, a masked tensor-core
  tile does the work of many gathered diagonals); at p=1 everything is dense, at p=1/2 with
  w=64 the reach stays w (the squares past 64 are >= 17 apart);
* ``attended``: int8 table of length R+1, the mask of the dense tiles where R > w;
* ``far``: the offsets beyond R, each handled as one gathered diagonal;
* per query block (forward, dq) and per key block (dk/dv): how many far offsets reach a key/query
  inside the sequence, so no program loops over diagonals that fall outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, Optional, Tuple

import numpy as np
import torch
import triton

from ..checks import triton_interpreting
from .kernels import ppa_bwd_dkdv_kernel, ppa_bwd_dq_kernel, ppa_fwd_kernel
from .plan import offsets_array, ppa_power_fraction

DENSE_GAP = 8
"""Offsets at most this far past the previous one join the dense tiles (see the module doc)."""

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """PPA's tiles: block_m query rows x block_n keys per step, warps and pipelining stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_config(head_dim: int, block_m: Optional[int] = None,
                  block_n: Optional[int] = None) -> LaunchConfig:
    """Fixed launch configuration (no autotuning: it must also run under TRITON_INTERPRET=1)."""
    if triton_interpreting():
        default_m = default_n = 16  # the interpreter runs every program in numpy: keep tiles small
    else:
        default_m = default_n = 64
    bd = max(16, triton.next_power_of_2(head_dim))
    return LaunchConfig(block_m=block_m or default_m, block_n=block_n or default_n,
                        num_warps=4 if bd <= 64 else 8, num_stages=2)


@dataclass(frozen=True)
class OffsetPlan:
    dense_reach: int
    use_lookup: bool
    attended: torch.Tensor  # int8 [R + 1]
    far: torch.Tensor  # int32 [n_far] (at least one element: a valid pointer when empty)
    n_far: int
    far_count_q: torch.Tensor  # int32 [cdiv(T, block_m)]
    far_count_k: torch.Tensor  # int32 [cdiv(T, block_n)]


def dense_reach(offsets: np.ndarray, window: int, dense_gap: int) -> int:
    """R >= w: the window, extended over the leading offsets that are <= dense_gap apart."""
    reach = window
    for s in offsets:
        if s <= reach:
            continue
        if s - reach > dense_gap:
            break
        reach = int(s)
    return reach


_PLANS: Dict[Tuple, OffsetPlan] = {}


def offset_plan(p: Fraction, window: int, T: int, dense_gap: int, block_m: int, block_n: int,
                device: torch.device) -> OffsetPlan:
    key = (p, window, T, dense_gap, block_m, block_n, str(device))
    if key in _PLANS:
        return _PLANS[key]
    offsets = offsets_array(p, max(T - 1, 0))  # S_p ∩ [1, T-1]: every offset that can matter
    reach = min(dense_reach(offsets, window, dense_gap), max(T - 1, 0))
    attended = np.zeros(reach + 1, dtype=np.int8)
    attended[: window + 1] = 1
    attended[offsets[offsets <= reach]] = 1
    far = offsets[offsets > reach].astype(np.int32)
    # query block m0..m0+BM-1 meets offset s iff s <= m0+BM-1; key block n0.. iff s <= T-1-n0
    last_query = np.minimum(np.arange(0, T, block_m) + block_m - 1, T - 1)
    far_count_q = np.searchsorted(far, last_query, side="right").astype(np.int32)
    far_count_k = np.searchsorted(far, T - 1 - np.arange(0, T, block_n), side="right")
    plan = OffsetPlan(
        dense_reach=reach,
        use_lookup=not bool(attended.all()),
        attended=torch.from_numpy(attended).to(device),
        far=torch.from_numpy(far if far.size else np.zeros(1, np.int32)).to(device),
        n_far=int(far.size),
        far_count_q=torch.from_numpy(far_count_q).to(device),
        far_count_k=torch.from_numpy(far_count_k.astype(np.int32)).to(device),
    )
    if len(_PLANS) > 256:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def sequence_bounds(cu_seqlens: torch.Tensor, T: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per token of a packed batch: the first position of its sequence and one past its last."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=T)
    ends = torch.repeat_interleave(cu[1:], lengths, output_size=T)
    return starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor, name: str) -> Dict[str, int]:
    """x's (b, t, h) strides as the kernels' keyword arguments ``stride_<name>b/t/h``."""
    return {f"stride_{name}b": x.stride(0), f"stride_{name}t": x.stride(1),
            f"stride_{name}h": x.stride(2)}


class PPAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p: Fraction, window: int, scale: float, dense_gap: int,
                cfg: LaunchConfig, cu_seqlens: Optional[torch.Tensor]):
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        B, T, H, D = q.shape
        G = H // k.shape[2]
        plan = offset_plan(p, window, T, dense_gap, cfg.block_m, cfg.block_n, q.device)
        varlen = cu_seqlens is not None
        # far counts stay those of the whole packed length: upper bounds, the masks do the rest
        seq_start, seq_end = (sequence_bounds(cu_seqlens.to(q.device), T) if varlen
                              else (plan.far, plan.far))  # unused pointers when not varlen
        o = torch.empty_like(q)
        lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 unused for 16-bit
        common = dict(HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_LOOKUP=plan.use_lookup,
                      VARLEN=varlen,
                      PREC=precision, UPCAST=q.dtype == torch.bfloat16 and triton_interpreting(),
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if T > 0:
            ppa_fwd_kernel[(triton.cdiv(T, cfg.block_m), B * H)](
                Q=q, K=k, V=v, O=o, LSE=lse, ATTENDED=plan.attended, FAR=plan.far,
                FAR_COUNT=plan.far_count_q, SEQ_START=seq_start, **_strides(q, "q"),
                **_strides(k, "k"), **_strides(v, "v"), **_strides(o, "o"), T=T, H=H, G=G,
                qk_scale=scale * LOG2E, dense_reach=plan.dense_reach, **common)
        ctx.save_for_backward(q, k, v, o, lse, seq_start, seq_end)
        ctx.plan, ctx.scale, ctx.common, ctx.cfg = plan, scale, common, cfg
        return o

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, o, lse, seq_start, seq_end = ctx.saved_tensors
        plan, scale, common, cfg = ctx.plan, ctx.scale, ctx.common, ctx.cfg
        d_out = _last_dim_contiguous(d_out)
        B, T, H, D = q.shape
        H_kv = k.shape[2]
        G = H // H_kv
        # delta_i = sum_d dO_id O_id: the softmax backward's row term, [B, H, T] fp32
        delta = (d_out.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if T > 0:
            ppa_bwd_dq_kernel[(triton.cdiv(T, cfg.block_m), B * H)](
                Q=q, K=k, V=v, DO=d_out, DQ=dq, LSE=lse, DELTA=delta, ATTENDED=plan.attended,
                FAR=plan.far, FAR_COUNT=plan.far_count_q, SEQ_START=seq_start, **_strides(q, "q"),
                **_strides(k, "k"), **_strides(v, "v"), **_strides(d_out, "do"),
                **_strides(dq, "dq"), T=T, H=H, G=G, qk_scale=scale * LOG2E, scale=scale,
                dense_reach=plan.dense_reach, **common)
            ppa_bwd_dkdv_kernel[(triton.cdiv(T, cfg.block_n), B * H_kv)](
                Q=q, K=k, V=v, DO=d_out, DK=dk, DV=dv, LSE=lse, DELTA=delta,
                ATTENDED=plan.attended, FAR=plan.far, FAR_COUNT=plan.far_count_k, SEQ_END=seq_end,
                **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"),
                **_strides(d_out, "do"), **_strides(dk, "dk"), **_strides(dv, "dv"), T=T, H=H,
                G=G, qk_scale=scale * LOG2E, scale=scale, dense_reach=plan.dense_reach, **common)
        return dq, dk, dv, None, None, None, None, None, None


def ppa_attention_kernel(q, k, v, power, window: int, scale: Optional[float] = None, *,
                         cu_seqlens: Optional[torch.Tensor] = None, dense_gap: int = DENSE_GAP,
                         block_m: Optional[int] = None,
                         block_n: Optional[int] = None) -> torch.Tensor:
    """PPA through the Triton kernels. q: [B, T, H, D]; k, v: [B, T, H_kv, D] -> [B, T, H, D].

    Arguments are those of ``ops.ppa_attention``, which checks them once and hands over ``power``
    as the ``Fraction`` of ``plan.ppa_power_fraction`` (taken as is here; a float from a direct
    call is converted and checked by it) and ``cu_seqlens`` (packed variable-length sequences,
    B = 1) already checked, so no second host sync (direct callers check it with
    ``checks.check_cu_seqlens``). ``dense_gap``, ``block_m`` and ``block_n`` tune the split
    between dense tiles and diagonals and the tile sizes (powers of two >= 16).
    """
    p = power if isinstance(power, Fraction) else ppa_power_fraction(power)
    D = q.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cfg = launch_config(D, block_m, block_n)
    for name, value in (("block_m", cfg.block_m), ("block_n", cfg.block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"ppa_attention_kernel: {name}={value} is invalid: allowed a power "
                             "of two >= 16")
    if isinstance(dense_gap, bool) or not isinstance(dense_gap, int) or dense_gap < 0:
        raise ValueError(f"ppa_attention_kernel: dense_gap={dense_gap!r} is invalid: allowed an "
                         "integer >= 0")
    return PPAFunction.apply(q, k, v, p, int(window), scale, dense_gap, cfg, cu_seqlens)
