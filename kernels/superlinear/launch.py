"""Superlinear's launch configuration: the tiles (``LaunchConfig``, ``launch_config``) and the
kernel choices (``launch_options``), both overridable by ``$MEGATRON_SUBQ_SUPERLINEAR_LAUNCH``.

Fixed, no autotuning: the kernels must also run under ``TRITON_INTERPRET=1``. The measurements
behind each default are in docs/benchmarks.md ("Current launch defaults" and the archive).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from ..checks import triton_interpreting

LAUNCH_ENV = "MEGATRON_SUBQ_SUPERLINEAR_LAUNCH"  # JSON overrides of the options below

# GQA groups of at least this many query heads take the grouped search (one load of each key row
# per group, tensor-core scores). Its cost goes with its programs, one per (position, KV head):
# below 4 heads per group the per-head kernel is as fast or faster.
GROUP_SEARCH_MIN = 4


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles per kind of kernel (no autotuning: it must also run under TRITON_INTERPRET=1).

    block_m x block_n: the query-centric attention kernels (window and span forward, their dq
    backward), rows (queries or pairs) x keys per step. kv_m x span_kv_n / window_kv_n: the
    key-centric dK/dV kernels, rows per tile x the program's key block. rows: the per-row
    kernels (search + top-k, mixture, gate backward, pair sorting). fwd_n: keys per step of
    the forward kernels (window and span forward; block_m rows). search_anchors: the grouped
    search's candidate anchors per step (``search_topk_group_kernel``)."""
    block_m: int
    block_n: int
    kv_m: int
    span_kv_n: int
    window_kv_n: int
    rows: int
    num_warps: int
    fwd_n: int
    search_anchors: int = 64  # the grouped search's candidate anchors per step


def launch_config(head_dim: int, block_m: Optional[int] = None, block_n: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None) -> LaunchConfig:
    """The fixed tiles. A caller's block_m / block_n set every kernel's tiles (the tests' ragged
    cases); the interpreter takes 16 (it runs programs in numpy); fp32 (for checking) 64
    everywhere, which fits shared memory; 16-bit inputs each kernel's fastest tiles on the GPU."""
    bd = max(16, triton.next_power_of_2(head_dim))
    warps = 4 if bd <= 64 else 8
    if block_m or block_n or triton_interpreting():
        m = block_m or (16 if triton_interpreting() else 64)
        n = block_n or (16 if triton_interpreting() else 64)
        anchors = 16 if triton_interpreting() else 64
        return LaunchConfig(block_m=m, block_n=n, kv_m=m, span_kv_n=n, window_kv_n=n, rows=m,
                            num_warps=warps, fwd_n=n, search_anchors=anchors)
    if dtype == torch.float32:
        return LaunchConfig(block_m=64, block_n=64, kv_m=64, span_kv_n=64, window_kv_n=64,
                            rows=64, num_warps=warps, fwd_n=64)
    return LaunchConfig(block_m=128, block_n=32, kv_m=64, span_kv_n=32, window_kv_n=64,
                        rows=32, num_warps=warps, fwd_n=64)


def launch_options() -> dict:
    """Kernel choices beyond the tiles, all on by default; off, each falls back to the torch or
    query-centric form it replaced (kept: the tests compare both paths).

    * window_dkdv / span_dkdv: the window's / span's dK, dV from a key-centric kernel
      (``window_bwd_dkdv_kernel``, ``span_bwd_dkdv_kernel``: each key block's sums in registers,
      written once) instead of atomic adds from the query-centric dq kernel.
    * elementwise_mix: the gate's scores and the gated mixture as broadcast products and sums
      instead of ``torch.einsum`` (which runs them as many tiny fp32 matrix products).
    * fused_mix: the gated mixture and its backward in Triton (``SuperlinearMixFunction``); the
      backward kernels then read dO with a per-row coefficient, never a per-pair dA.
    * fused_merge: the log-sum-exp merge of span and window outputs in ``span_fwd_kernel``'s
      epilogue instead of torch passes over [B·H, T, k, D] fp32 tensors.
    * gate_kernel: the gate's kept scores are the search kernel's (``KeptScoresFunction``, backward
      ``gate_bwd_kernel``) instead of gathered keys in a [B, T, H, k, D] fp32 tensor.
    * sorted_pairs: the span dK/dV kernel reads its pairs' rows from copies in the sorted order
      (``sort_pairs_kernel``) instead of gathering them through the order at every visit.
    * group_search, group_search_min (default ``GROUP_SEARCH_MIN``): GQA groups of that many or
      more query heads search in one program per position (``search_topk_group_kernel``).

    Any field of ``LaunchConfig`` (``block_m``, ``kv_m``, ``num_warps``…; unset) overrides
    ``launch_config``'s tiles, for A/B runs. ``$MEGATRON_SUBQ_SUPERLINEAR_LAUNCH`` (JSON)
    overrides them, read once per op call (and handed to the backward)."""
    options = dict(window_dkdv=True, span_dkdv=True, elementwise_mix=True, fused_merge=True,
                   fused_mix=True, gate_kernel=True, sorted_pairs=True, group_search=True,
                   group_search_min=GROUP_SEARCH_MIN)
    overrides = os.environ.get(LAUNCH_ENV)
    if overrides:
        options.update(json.loads(overrides))
    return options


def tiles(head_dim: int, block_m: Optional[int], block_n: Optional[int], dtype,
          options: dict) -> LaunchConfig:
    """The launch config of ``launch_config``, with any of its fields (``block_m``,
    ``kv_m``, ``num_warps``…) overridden by the launch options of the same name (A/B runs)."""
    cfg = launch_config(head_dim, block_m, block_n, dtype)
    return dataclasses.replace(cfg, **{f.name: options[f.name]
                                       for f in dataclasses.fields(cfg) if f.name in options})


def precision(dtype: torch.dtype) -> str:
    """The dots' precision: exact for fp32 (the checking dtype), tf32 otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit operands


def attention_args(q, k):
    """What every attention kernel launch takes from q [B, T, H, D] and k: the softmax scale,
    the padded head dim, the dot precision, and q's and k's (b, t, h) strides (v shares k's)
    as the kernels' keyword arguments ``s_qb`` … ``s_kh``."""
    D = q.shape[-1]
    strides = dict(s_qb=q.stride(0), s_qt=q.stride(1), s_qh=q.stride(2), s_kb=k.stride(0),
                   s_kt=k.stride(1), s_kh=k.stride(2))
    return 1.0 / math.sqrt(D), max(16, triton.next_power_of_2(D)), precision(q.dtype), strides
