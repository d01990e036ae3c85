"""Benchmark the attention ops' kernels against dense and linear-attention baselines (one GPU).

    python tools/bench_ops.py --ops asa --lengths 2048,4096,8192,16384,32768,65536,131072 \
        --json bench.json

For every sequence length: forward and forward+backward time (median of
``triton.testing.do_bench``) of each op's kernel and of the baselines, all in the same process
and run — cuDNN SDPA (causal, dense), FlashAttention-2 (torch's flash SDPA backend) and, when fla
is installed, fla's ``chunk_linear_attn`` (the linear-attention peer, on m-dimensional features).
Printed as a table (ratios against cuDNN) and written as JSON with the GPU name, the date and the
exact command.

Superlinear inference (issue 7; Nemotron layout 32 query / 2 KV heads, d = 128):

    python tools/bench_ops.py --ops superlinear_prefill --heads 32 --kv-heads 2 \
        --lengths 16384,32768,65536 --json prefill.json         # vs cuDNN dense prefill
    python tools/bench_ops.py --ops superlinear_prefill --baselines "" --heads 32 --kv-heads 2 \
        --lengths 131072,262144,524288,1048576                  # chunked prefill up to 1M
    python tools/bench_ops.py --ops superlinear_decode --baselines "" --heads 32 --kv-heads 2 \
        --lengths 65536,262144,1048576 --json decode.json       # decode vs SDPA over the cache

``superlinear_decode`` rows time one step over a cache of T tokens and carry their own dense
baseline (``sdpa_decode[...]``); their ratio is printed as "x dense decode".

Adding an op: write ``bench_<op>(args, T, dtype) -> [(row_name, fwd_fn, fwd_bwd_fn, info)]`` and
register it in ``OP_BENCHES``; ``fwd_fn()`` runs the forward only, ``fwd_bwd_fn()`` forward and
backward, ``info`` is a dict (e.g. the minimal HBM bytes of the forward, for a bandwidth figure).
A row whose inputs do not fit (out of memory), or a dense backend without a kernel for the shape
(cuDNN and FlashAttention-2 stop at d_h 256), is recorded as skipped, not fatal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

Row = Tuple[str, Callable[[], None], Callable[[], None], dict]


def _randn(*shape, dtype, grad=True, scale=1.0):
    t = torch.randn(*shape, device="cuda", dtype=torch.float32) * scale
    return t.to(dtype).requires_grad_(grad)


def _fwd_bwd(fn: Callable[[], torch.Tensor], inputs) -> Tuple[Callable, Callable]:
    """The forward alone (no autograd graph) and forward+backward with a fixed random dO."""
    with torch.no_grad():
        grad_out = torch.randn_like(fn())

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(grad_out)
        for x in inputs:
            x.grad = None

    return fwd, fwd_bwd


# ------------------------------------------------------------------------------------------
# baselines
# ------------------------------------------------------------------------------------------
def bench_dense(args, T: int, dtype) -> List[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, D = args.batch, args.heads, args.head_dim
    q, k, v = (_randn(B, H, T, D, dtype=dtype) for _ in range(3))  # SDPA's [B, H, T, D]
    rows = []
    for name, backend in (("cudnn_sdpa", SDPBackend.CUDNN_ATTENTION),
                          ("flash2_sdpa", SDPBackend.FLASH_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        flops = 4 * B * H * D * T * T / 2  # causal: half of QK^T and PV
        try:
            fwd, fwd_bwd = _fwd_bwd(run, (q, k, v))
        except RuntimeError as err:  # no kernel of this backend for the shape (e.g. d_h 512)
            if isinstance(err, torch.OutOfMemoryError):
                raise
            why = str(err).splitlines()[0]
            print(f"{name} at T={T}, d_h={D}: skipped ({why})", file=sys.stderr)
            rows.append((name, None, None, {"fwd_flops": flops, "skipped": why}))
            continue
        rows.append((name, fwd, fwd_bwd, {"fwd_flops": flops}))
    return rows


def bench_fla_linear(args, T: int, dtype) -> List[Row]:
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return []
    B, H, m, Dv = args.batch, args.heads, args.rank, args.head_dim
    q = _randn(B, T, H, m, dtype=dtype)  # fla's inputs: the m-dimensional features
    k = _randn(B, T, H, m, dtype=dtype)
    v = _randn(B, T, H, Dv, dtype=dtype)
    rows = []
    for normalize in (False, True):
        def run(normalize=normalize):
            return chunk_linear_attn(q, k, v, normalize=normalize)[0]

        fwd, fwd_bwd = _fwd_bwd(run, (q, k, v))
        rows.append((f"fla_chunk_linear_attn{'_norm' if normalize else ''}", fwd, fwd_bwd, {}))
    return rows


# ------------------------------------------------------------------------------------------
# ops
# ------------------------------------------------------------------------------------------
def bench_asa(args, T: int, dtype) -> List[Row]:
    from megatron_subq.ops import asa_attention

    B, H, D, m = args.batch, args.heads, args.head_dim, args.rank
    H_kv = args.kv_heads or H
    q = _randn(B, T, H, D, dtype=dtype)
    k = _randn(B, T, H_kv, D, dtype=dtype)
    v = _randn(B, T, H_kv, D, dtype=dtype)
    p_q = _randn(H, D, m, dtype=dtype, scale=D ** -0.5)
    p_k = _randn(H, D, m, dtype=dtype, scale=D ** -0.5)
    elt = torch.finfo(dtype).bits // 8
    # each input read once, the output written once (the floor a fused forward can reach)
    fwd_bytes = elt * B * T * D * (2 * H + 2 * H_kv)
    from megatron_subq.kernels.asa.function import LAUNCH_ENV

    rows = []
    for launch in args.asa_launch or [""]:
        for normalize in args.asa_normalize.split(","):
            def run(normalize=normalize, launch=launch):
                # launch-config overrides (sweeps) travel through the kernel's environment knob
                if launch:
                    os.environ[LAUNCH_ENV] = launch
                else:
                    os.environ.pop(LAUNCH_ENV, None)
                return asa_attention(q, k, v, p_q, p_k, normalize=normalize, impl="kernel")

            fwd, fwd_bwd = _fwd_bwd(run, (q, k, v, p_q, p_k))
            name = f"asa_kernel[{normalize}]" + (launch.replace(" ", "") if launch else "")
            rows.append((name, fwd, fwd_bwd, {"fwd_min_bytes": fwd_bytes}))
    return rows


# Issue 7's configuration: w = 1088 (sw_index 32), top-2, b = 4, f = 2, p = p_sp = 1/2
SUPERLINEAR_KNOBS = dict(search_power=0.5, span_power=0.5, topk=2, backward_factor=4.0,
                         forward_factor=2.0, sw_index=32)


def _superlinear_knobs(args) -> dict:
    return {**SUPERLINEAR_KNOBS, **json.loads(args.superlinear_knobs or "{}")}


def bench_superlinear(args, T: int, dtype) -> List[Row]:
    """Issue 7's configuration: w = 1088 (sw_index 32), top-2, b = 4, f = 2, p = p_sp = 1/2."""
    from megatron_subq.ops import superlinear_attention

    B, H, D = args.batch, args.heads, args.head_dim
    H_kv = args.kv_heads or H
    q = _randn(B, T, H, D, dtype=dtype)
    q_s = _randn(B, T, H, D, dtype=dtype, scale=D ** -0.5)
    k = _randn(B, T, H_kv, D, dtype=dtype)
    v = _randn(B, T, H_kv, D, dtype=dtype)
    knobs = _superlinear_knobs(args)

    def run():
        return superlinear_attention(q, q_s, k, v, **knobs, impl="kernel")

    fwd, fwd_bwd = _fwd_bwd(run, (q, q_s, k, v))
    # keys per query: window + top-k spans of (b + f) * sqrt(T) (an upper bound)
    keys = min(T, 1088 + 2 * (6 * math.isqrt(T) + 1))
    flops = 4 * B * H * D * T * keys
    return [("superlinear_kernel", fwd, fwd_bwd, {"fwd_flops_bound": flops})]


def bench_superlinear_prefill(args, T: int, dtype) -> List[Row]:
    """Chunked prefill of T tokens, forward only: each chunk of --superlinear-chunk queries
    against the cached keys of every earlier position (``ops.superlinear_prefill``). One row per
    chunk size; the time is the whole prefill (all chunks), so "x cuDNN fwd" compares it with
    dense causal attention over the same T tokens. Use --heads 32 --kv-heads 2 (Nemotron)."""
    from megatron_subq.ops import superlinear_decode_cost, superlinear_prefill

    B, H, D = args.batch, args.heads, args.head_dim
    H_kv = args.kv_heads or H
    q = _randn(B, T, H, D, dtype=dtype, grad=False)
    q_s = _randn(B, T, H, D, dtype=dtype, grad=False, scale=D ** -0.5)
    k = _randn(B, T, H_kv, D, dtype=dtype, grad=False)
    v = _randn(B, T, H_kv, D, dtype=dtype, grad=False)
    knobs = _superlinear_knobs(args)
    # keys per query <= those of the last one (window + top-k spans): an upper bound of the work
    keys = superlinear_decode_cost(T, **knobs)
    info = {"fwd_flops_bound": 4 * B * H * D * T * (keys["spans"] + keys["window"])}
    rows = []
    for chunk in sorted({min(T, int(c)) for c in args.superlinear_chunk.split(",")}):
        def run(chunk=chunk):
            for start in range(0, T, chunk):
                stop = min(T, start + chunk)
                superlinear_prefill(q[:, start:stop], q_s[:, start:stop], k[:, :stop],
                                    v[:, :stop], start=start, **knobs, impl="kernel")

        rows.append((f"superlinear_prefill[chunk={chunk}]", run, None, info))
    return rows


def _superlinear_decode_configs(args) -> List[tuple]:
    """(chunk, launch overrides, row tag) for each --superlinear-decode-chunk and each
    --superlinear-decode-launch (JSON: block_n, warps, mma; none: the kernel's defaults)."""
    launches = [json.loads(x) for x in args.superlinear_decode_launch] or [{}]
    for launch in launches:
        if not isinstance(launch, dict) or set(launch) - {"block_n", "warps", "mma"}:
            raise SystemExit(f"--superlinear-decode-launch {launch!r}: allowed a JSON object "
                             "with the keys block_n, warps, mma")
    out = []
    for chunk in (int(c) for c in args.superlinear_decode_chunk.split(",")):
        for launch in launches:
            tag = ",".join([f"chunk={chunk}"] + [f"{k}={launch[k]}" for k in sorted(launch)])
            out.append((chunk, launch, tag))
    return out


def bench_superlinear_decode(args, T: int, dtype) -> List[Row]:
    """One decode step at position T - 1 over a cache of T tokens (forward only): the
    superlinear decode kernel (one row per --superlinear-decode-chunk, its split-K part size)
    against dense decode attention, SDPA over the full cache (flash / efficient backends, native
    GQA, the cache in SDPA's [B, H_kv, T, D] layout). ``fwd_min_bytes``: the cache rows a step
    must read (superlinear: ``ops.superlinear_decode_cost``; dense: all of K and V)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_subq.kernels.superlinear import superlinear_decode_kernel
    from megatron_subq.ops import superlinear_decode_cost, superlinear_decode_step

    B, H, D = args.batch, args.heads, args.head_dim
    H_kv = args.kv_heads or H
    elt = torch.finfo(dtype).bits // 8
    knobs = _superlinear_knobs(args)
    q = _randn(B, H, D, dtype=dtype, grad=False)
    q_s = _randn(B, H, D, dtype=dtype, grad=False, scale=D ** -0.5)
    k_cache = _randn(B, T, H_kv, D, dtype=dtype, grad=False)
    v_cache = _randn(B, T, H_kv, D, dtype=dtype, grad=False)
    cost = superlinear_decode_cost(T, **knobs)
    # anchor keys and window rows are read once per key head, span rows once per query head
    sparse_bytes = elt * B * D * (H_kv * (cost["search"] + 2 * cost["window"])
                                  + H * 2 * cost["spans"])
    rows = []
    configs = _superlinear_decode_configs(args)
    for chunk, launch, tag in configs:
        def run(chunk=chunk, launch=launch):
            superlinear_decode_kernel(q, q_s, k_cache, v_cache, T, **knobs, chunk=chunk, **launch)

        torch.testing.assert_close(  # the kernel the op dispatches to, and the same result
            superlinear_decode_kernel(q, q_s, k_cache, v_cache, T, **knobs, chunk=chunk,
                                      **launch),
            superlinear_decode_step(q, q_s, k_cache, v_cache, **knobs, impl="kernel"),
            rtol=2e-2, atol=2e-2)
        rows.append((f"superlinear_decode[{tag}]", run, None,
                     {"decode": True, "fwd_min_bytes": sparse_bytes,
                      "keys_per_head": cost["total"], "launch": dict(launch, chunk=chunk)}))

    # the capturable form (kernels.superlinear.SuperlinearDecodePlan): the plan's launches
    # alone, and a generation step as it would run one, set_length + the captured graph's replay
    # (host work included: what a decode loop pays per attention layer)
    from megatron_subq.cuda_graphs import capture_cuda_graph
    from megatron_subq.kernels.superlinear import SuperlinearDecodePlan
    from megatron_subq.ops.superlinear import capacity_bucket

    for chunk, launch, tag in configs:
        plan = SuperlinearDecodePlan(B, H, H_kv, D, capacity_bucket(T), dtype, q.device,
                                     **knobs, chunk=chunk, **launch)
        plan.set_length(T)
        eager = superlinear_decode_kernel(q, q_s, k_cache, v_cache, T, **knobs, chunk=chunk,
                                          **launch)
        if not torch.equal(plan.run(q, q_s, k_cache, v_cache), eager):
            raise AssertionError(f"decode plan != eager kernel at T={T}, {tag}")

        def launches(plan=plan):
            plan.run(q, q_s, k_cache, v_cache)

        graph, _ = capture_cuda_graph(launches)

        def step(plan=plan, graph=graph):
            plan.set_length(T)
            graph.replay()

        info = {"decode": True, "fwd_min_bytes": sparse_bytes, "keys_per_head": cost["total"],
                "launch": dict(launch, chunk=chunk)}
        rows.append((f"superlinear_decode_plan[{tag}]", launches, None, dict(info)))
        rows.append((f"superlinear_decode_graph_step[{tag}]", step, None, dict(info)))

    # dense decode as the model's standard layers run it: ops.standard_prefill on the cache's
    # own [B, T, H_kv, D] buffers (SDPA's GQA on their transposed views, no copy)
    from megatron_subq.ops import standard_prefill

    rows.append(("standard_prefill_decode[cache layout]",
                 lambda: standard_prefill(q[:, None], k_cache, v_cache), None,
                 {"decode": True, "fwd_min_bytes": elt * B * H_kv * T * D * 2}))
    # dense decode: its own copy of the cache in SDPA's layout (not counted in the timing)
    k_dense, v_dense = (x.transpose(1, 2).contiguous() for x in (k_cache, v_cache))
    q_dense = q[:, :, None]  # [B, H, 1, D]
    dense_bytes = elt * B * H_kv * T * D * 2
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):  # one query at the end sees every key: no causal mask
                F.scaled_dot_product_attention(q_dense, k_dense, v_dense, enable_gqa=True)

        try:
            run()
        except RuntimeError as err:  # this backend does not take the shape
            print(f"sdpa_decode[{name}] at T={T}: skipped ({str(err).splitlines()[0]})",
                  file=sys.stderr)
            continue
        rows.append((f"sdpa_decode[{name}]", run, None,
                     {"decode": True, "dense_decode": True, "fwd_min_bytes": dense_bytes}))
    return rows


def bench_ppa(args, T: int, dtype) -> List[Row]:
    """PPA's kernel (one row per --ppa-dense-gap) and flex-attention with the same mask.

    ``fwd_flops`` counts the useful work only (4 * D flops per attended query-key pair, pairs
    counted exactly from the offsets); ``fwd_min_bytes`` reads q, k, v and writes o once.
    """
    from megatron_subq.kernels.ppa import ppa_attention_kernel
    from megatron_subq.ops import ppa_offsets

    B, H, D = args.batch, args.heads, args.head_dim
    H_kv = args.kv_heads or H
    p, w = float(args.ppa_power), args.ppa_window
    q = _randn(B, T, H, D, dtype=dtype)
    k = _randn(B, T, H_kv, D, dtype=dtype)
    v = _randn(B, T, H_kv, D, dtype=dtype)
    offsets = sorted(set(range(min(w, T - 1) + 1)) | set(ppa_offsets(p, T - 1)))
    pairs = sum(T - d for d in offsets)  # query i meets key i - d for every attended d <= i
    elt = torch.finfo(dtype).bits // 8
    info = {"fwd_flops": 4 * B * H * D * pairs, "pairs_per_query": pairs / T,
            "fwd_min_bytes": elt * B * T * D * (2 * H + 2 * H_kv)}
    rows = []
    for gap in (int(g) for g in args.ppa_dense_gap.split(",")):
        def run(gap=gap):
            return ppa_attention_kernel(q, k, v, p, w, dense_gap=gap)

        fwd, fwd_bwd = _fwd_bwd(run, (q, k, v))
        rows.append((f"ppa_kernel[p={p:g},w={w},gap={gap}]", fwd, fwd_bwd, info))
    if T <= args.ppa_flex_max_len:
        try:  # flex's block mask or compile failing must not cost the kernel rows
            rows.extend(_flex_ppa_rows(q, k, v, p, w, info))
        except Exception as e:  # noqa: BLE001 - reported, the benchmark goes on
            print(f"flex_ppa at T={T} skipped: {type(e).__name__}: {e}", file=sys.stderr)
            torch.cuda.empty_cache()
    return rows


def _flex_ppa_rows(q, k, v, p: float, w: int, info: dict) -> List[Row]:
    """flex-attention (compiled) with the PPA mask, as the paper ran it."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return []
    from megatron_subq.ops import ppa_offsets

    B, T, H, D = q.shape
    attended = torch.zeros(T, dtype=torch.bool, device=q.device)
    attended[: w + 1] = True
    attended[torch.tensor(ppa_offsets(p, T - 1), dtype=torch.long, device=q.device)] = True

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & attended[d.clamp(min=0)]

    block_mask = create_block_mask(mask_mod, None, None, T, T, device=q.device)
    flex = torch.compile(flex_attention)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # flex wants [B, H, T, D]
    gqa = kt.shape[1] != qt.shape[1]

    def run():
        return flex(qt, kt, vt, block_mask=block_mask, enable_gqa=gqa)

    fwd, fwd_bwd = _fwd_bwd(run, (q, k, v))
    return [(f"flex_ppa[p={p:g},w={w}]", fwd, fwd_bwd, info)]


def _deconstructed_inputs(args, T: int, dtype):
    B, H, D = args.batch, args.heads, args.head_dim
    H_kv = args.kv_heads or H
    q = _randn(B, T, H, D, dtype=dtype)
    k = _randn(B, T, H_kv, D, dtype=dtype)
    v = _randn(B, T, H_kv, D, dtype=dtype)
    elt = torch.finfo(dtype).bits // 8
    return q, k, v, elt * B * T * D * (2 * H + 2 * H_kv)  # q, k, v read once, o written once


def bench_nonapprox(args, T: int, dtype) -> List[Row]:
    """nonapprox's kernel: a cumulative softmax-weighted mean, bound by HBM bandwidth."""
    from megatron_subq.ops import nonapprox_attention

    q, k, v, fwd_bytes = _deconstructed_inputs(args, T, dtype)

    def run():
        return nonapprox_attention(q, k, v, impl="kernel")

    fwd, fwd_bwd = _fwd_bwd(run, (q, k, v))
    return [("nonapprox_kernel", fwd, fwd_bwd, {"fwd_min_bytes": fwd_bytes})]


def bench_approx(args, T: int, dtype) -> List[Row]:
    """approx's kernel: two chunked linear attentions (D features each) plus a running mean.

    ``fwd_flops`` counts the forward's matmuls at chunk C = 64 per (query head, token): the two
    [C, C] score blocks (2·2CD), their products with v (2·2CD), the running mean (2CD), the two
    inter-chunk products with the D × D states (2·2D²) and the two state updates (2·2D², per
    key/value head)."""
    from megatron_subq.ops import approx_attention

    q, k, v, fwd_bytes = _deconstructed_inputs(args, T, dtype)
    B, H, D = args.batch, args.heads, args.head_dim
    H_kv, C = args.kv_heads or H, 64
    flops = B * T * (H * (10 * C * D + 4 * D * D) + H_kv * 4 * D * D)
    from megatron_subq.kernels.approx.function import LAUNCH_ENV

    rows = []
    for launch in args.approx_launch or [""]:
        def run(launch=launch):
            # launch-config overrides (A/B, e.g. '{"scan": "sequential"}') travel through the
            # kernel's environment knob, read on every call
            if launch:
                os.environ[LAUNCH_ENV] = launch
            else:
                os.environ.pop(LAUNCH_ENV, None)
            return approx_attention(q, k, v, impl="kernel")

        fwd, fwd_bwd = _fwd_bwd(run, (q, k, v))
        name = "approx_kernel" + (launch.replace(" ", "") if launch else "")
        rows.append((name, fwd, fwd_bwd, {"fwd_min_bytes": fwd_bytes, "fwd_flops": flops}))
    return rows


OP_BENCHES: Dict[str, Callable[..., List[Row]]] = {
    "asa": bench_asa,
    "nonapprox": bench_nonapprox,
    "approx": bench_approx,
    "ppa": bench_ppa,
    "superlinear": bench_superlinear,
    "superlinear_prefill": bench_superlinear_prefill,
    "superlinear_decode": bench_superlinear_decode,
}
BASELINES: Dict[str, Callable[..., List[Row]]] = {
    "dense": bench_dense,
    "fla": bench_fla_linear,
}


# ------------------------------------------------------------------------------------------
def _time(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _graph_replay(fn) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph; returns the replay. Timing the replay measures the GPU
    work alone, without the host's per-launch cost — what a CUDA-graphed training step sees."""
    from megatron_subq.cuda_graphs import capture_cuda_graph

    return capture_cuda_graph(fn, warmup=3)[0].replay


def report(meta: dict, results: list, plot_path: str = "") -> None:
    """Ratios against cuDNN, the table, and optionally the plot."""
    cudnn = {r["T"]: r for r in results if r.get("impl") == "cudnn_sdpa"}
    for r in results:
        base = cudnn.get(r["T"])
        for key in ("fwd_ms", "fwd_bwd_ms", "fwd_graph_ms", "fwd_bwd_graph_ms"):
            if base and base.get(key) and r.get(key):
                r[f"speedup_vs_cudnn_{key[:-3]}"] = base[key] / r[key]

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) and not math.isnan(x) else "-"

    print(f"\n{meta['gpu']}  {meta['date']}  {meta['command']}")
    print(f"{'T':>7} {'impl':<44} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x cuDNN fwd':>12} "
          f"{'x cuDNN f+b':>12} {'fwd GB/s':>9}")
    for r in results:
        print(f"{r['T']:>7} {r['impl']:<44} {fmt(r.get('fwd_ms'), '9.3f')} "
              f"{fmt(r.get('fwd_bwd_ms'), '11.3f')} {fmt(r.get('speedup_vs_cudnn_fwd'), '12.2f')} "
              f"{fmt(r.get('speedup_vs_cudnn_fwd_bwd'), '12.2f')} "
              f"{fmt(r.get('fwd_GBps_of_min_bytes'), '9.0f')}")
    graphed = [r for r in results if r.get("fwd_bwd_graph_ms") or r.get("fwd_graph_ms")]
    if graphed:  # --cuda-graph: the GPU's time alone, ratios against cuDNN's graph replay
        print(f"\nCUDA graph replays\n{'T':>7} {'impl':<44} {'fwd ms':>9} {'fwd+bwd ms':>11} "
              f"{'x cuDNN fwd':>12} {'x cuDNN f+b':>12}")
        for r in graphed:
            print(f"{r['T']:>7} {r['impl']:<44} {fmt(r.get('fwd_graph_ms'), '9.3f')} "
                  f"{fmt(r.get('fwd_bwd_graph_ms'), '11.3f')} "
                  f"{fmt(r.get('speedup_vs_cudnn_fwd_graph'), '12.2f')} "
                  f"{fmt(r.get('speedup_vs_cudnn_fwd_bwd_graph'), '12.2f')}")
    caller = [r for r in results if r.get("fwd_bwd_caller_thread_ms")]
    if caller:  # --caller-thread-backward: eager with the backward on the calling thread
        print(f"\nEager fwd+bwd, backward on the engine's device thread / on the calling "
              f"thread\n{'T':>7} {'impl':<44} {'engine ms':>10} {'caller ms':>10} "
              f"{'graph ms':>9}")
        for r in caller:
            print(f"{r['T']:>7} {r['impl']:<44} {fmt(r.get('fwd_bwd_ms'), '10.3f')} "
                  f"{fmt(r.get('fwd_bwd_caller_thread_ms'), '10.3f')} "
                  f"{fmt(r.get('fwd_bwd_graph_ms'), '9.3f')}")
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwd_bwd_ms",
                                                                  "forward + backward")):
            for n, impl in enumerate(dict.fromkeys(r["impl"] for r in results)):
                color = f"C{n % 10}"
                pts = sorted((r["T"], r[key]) for r in results if r["impl"] == impl and r.get(key))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=color, label=impl)
                # --cuda-graph rows: the GPU time alone, dashed in the same colour
                graph_key = key.replace("_ms", "_graph_ms")
                pts = sorted((r["T"], r[graph_key]) for r in results
                             if r["impl"] == impl and r.get(graph_key))
                if pts:
                    ax.plot(*zip(*pts), linestyle="--", marker=".", color=color,
                            label=f"{impl} (CUDA graph)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel("ms (median)")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        axes[1].legend(fontsize=7)
        shape = meta.get("shape", {})
        fig.suptitle(f"{meta['gpu']}, {meta['date'][:10]}, "
                     + ", ".join(f"{k}={v}" for k, v in shape.items()), fontsize=9)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=110)


def _profile(name: str, fn, top: int = 15) -> dict:
    """CUDA time per kernel (µs) of one call of ``fn`` after a warm-up, largest first: where a
    row's time goes (do_bench's median also holds launch gaps and host overhead)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for ev in prof.key_averages():
        # only CUDA activity is recorded: every event is a kernel, memcpy or memset
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if us > 0:
            per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + us
    ranked = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top])
    total = sum(per_kernel.values())
    # the same call's wall time without the profiler: kernel time / wall time is how busy the GPU
    # is kept (low: launch or host overhead, not the kernels, sets the time)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e6
    print(f"profile {name}: {total:.0f} us of kernels in one call of {wall:.0f} us wall "
          f"({100 * total / wall:.0f}% GPU busy)", flush=True)
    for key, us in ranked.items():
        print(f"  {us:9.1f} us  {key[:100]}", flush=True)
    return {"total": total, "wall": wall, **ranked}


def _host_profile(name: str, fn, calls: int, top: int = 25) -> float:
    """Host (Python) time per call of ``fn``, and where it goes (cProfile, own time).

    The calls are issued back to back and synchronised once at the end; at short lengths the
    GPU finishes each call's kernels before the host has issued the next, so this time, not
    the kernels', is what do_bench measures there."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    host_us = (time.perf_counter() - start) * 1e6 / calls
    torch.cuda.synchronize()
    print(f"host profile {name}: {host_us:.0f} us of host time per call (under cProfile)",
          flush=True)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    for (path, line, func), (_cc, ncalls, own, cum, _callers) in rows:
        print(f"  {1e6 * own / calls:8.1f} us own {1e6 * cum / calls:8.1f} us cum "
              f"{ncalls // calls:4d}x  {os.path.basename(path)}:{line} {func}", flush=True)
    return host_us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", default="asa", help=f"comma list of {sorted(OP_BENCHES)}")
    p.add_argument("--baselines", default="dense,fla", help=f"comma list of {sorted(BASELINES)}")
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536,131072")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: as many as --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=64, help="ASA's m (and fla's feature size)")
    p.add_argument("--asa-normalize", default="linear")
    p.add_argument("--ppa-power", default="0.5", help="PPA's p (a rational, e.g. 0.5, 0.75)")
    p.add_argument("--ppa-window", type=int, default=64, help="PPA's w")
    p.add_argument("--ppa-dense-gap", default="8",
                   help="comma list: offsets at most this far apart join PPA's dense tiles")
    p.add_argument("--ppa-flex-max-len", type=int, default=16384,
                   help="flex-attention rows for PPA up to this length (0: none)")
    p.add_argument("--asa-launch", action="append", default=[],
                   help="JSON launch-config override of the ASA kernel (repeat to sweep)")
    p.add_argument("--approx-launch", action="append", default=[],
                   help="JSON launch-config override of the approx kernel (repeat to sweep, "
                        "e.g. --approx-launch '{}' --approx-launch '{\"scan\": \"sequential\"}')")
    p.add_argument("--superlinear-knobs", default="",
                   help="JSON dict over superlinear's issue-7 knobs (w=1088, top-2, b=4, f=2)")
    p.add_argument("--superlinear-chunk", default="32768",
                   help="comma list: superlinear_prefill chunk sizes (queries per chunk)")
    p.add_argument("--superlinear-decode-chunk", default="512",
                   help="comma list: keys per split-K part of the superlinear decode kernel")
    p.add_argument("--superlinear-decode-launch", action="append", default=[],
                   help="JSON launch override of the superlinear decode kernels: block_n, warps, "
                        "mma (repeat to sweep; rows per chunk x launch)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--profile", action="store_true",
                   help="also print each of our rows' per-kernel CUDA time of one fwd+bwd "
                        "(torch.profiler) and store it in the JSON")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="time each row N times (each a do_bench median) and report the median "
                        "of those, keeping all N in the JSON (fwd_ms_runs, fwd_bwd_ms_runs): "
                        "host-bound rows move between runs")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time each row captured in a CUDA graph (fwd_graph_ms, "
                        "fwd_bwd_graph_ms in the JSON): the GPU's time without host overhead")
    p.add_argument("--caller-thread-backward", action="store_true",
                   help="also time the eager fwd+bwd with the backward on the calling thread "
                        "(torch.autograd.set_multithreading_enabled(False)): "
                        "fwd_bwd_caller_thread_ms in the JSON")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="also run N fwd+bwd calls of each of our rows under cProfile and print "
                        "the host time per call and the functions that take it")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--plot", default="", help="write a log-log plot of time vs length (PNG)")
    p.add_argument("--replot", default="", help="print the table and plot of a saved JSON "
                   "(no GPU needed) instead of measuring")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: {args.repeat} is not allowed; give a count of 1 or more")
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        report(saved, saved["results"], args.plot)
        return 0
    if not torch.cuda.is_available():
        print("bench_ops.py needs a CUDA GPU", file=sys.stderr)
        return 2
    for name in args.ops.split(","):
        if name not in OP_BENCHES:
            p.error(f"--ops: {name!r} is not one of {sorted(OP_BENCHES)}")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
                  "head_dim": args.head_dim, "rank": args.rank, "dtype": args.dtype},
    }
    results = []
    for T in (int(x) for x in args.lengths.split(",")):
        builders = [BASELINES[b] for b in args.baselines.split(",") if b] + \
                   [OP_BENCHES[o] for o in args.ops.split(",")]
        for build in builders:
            try:
                rows = build(args, T, dtype)
            except torch.OutOfMemoryError:
                results.append({"T": T, "impl": build.__name__, "skipped": "out of memory"})
                torch.cuda.empty_cache()
                continue
            for name, fwd, fwd_bwd, info in rows:
                rec = {"T": T, "impl": name, **info}
                for key, fn in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
                    if fn is None:  # forward-only rows (inference: prefill, decode)
                        rec[key] = None
                        continue
                    try:
                        times = [_time(fn) for _ in range(args.repeat)]
                        rec[key] = statistics.median(times)
                        if args.repeat > 1:  # the spread between do_bench runs (host noise)
                            rec[key + "_runs"] = times
                    except torch.OutOfMemoryError:
                        rec[key] = None
                        rec["skipped"] = "out of memory"
                        torch.cuda.empty_cache()
                if args.caller_thread_backward and fwd_bwd is not None:
                    # the backward on the calling thread instead of the autograd engine's CUDA
                    # device thread: the eager time without the engine's two thread hand-offs
                    # per call (which a training step pays once per backward, not per op)
                    with torch.autograd.set_multithreading_enabled(False):
                        times = [_time(fwd_bwd) for _ in range(args.repeat)]
                    rec["fwd_bwd_caller_thread_ms"] = statistics.median(times)
                    if args.repeat > 1:
                        rec["fwd_bwd_caller_thread_ms_runs"] = times
                if args.profile and build in OP_BENCHES.values():
                    try:
                        rec["profile_us"] = _profile(name, fwd_bwd or fwd)
                    except Exception as e:  # noqa: BLE001 - a profiler failure must not cost the row
                        print(f"profile of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
                if args.cuda_graph:
                    for key, fn in (("fwd_graph_ms", fwd), ("fwd_bwd_graph_ms", fwd_bwd)):
                        if fn is None:
                            continue
                        try:
                            rec[key] = _time(_graph_replay(fn))
                        except Exception as e:  # noqa: BLE001 - reported, the row is kept
                            rec[key] = None
                            rec.setdefault("graph_error", f"{type(e).__name__}: {e}"[:300])
                            torch.cuda.synchronize()
                    print(f"graph {T} {name}: fwd {rec.get('fwd_graph_ms')} ms, fwd+bwd "
                          f"{rec.get('fwd_bwd_graph_ms')} ms", flush=True)
                if args.host_profile and build in OP_BENCHES.values():
                    rec["host_us_per_call"] = _host_profile(name, fwd_bwd or fwd,
                                                            args.host_profile)
                if rec.get("fwd_min_bytes") and rec.get("fwd_ms"):
                    rec["fwd_GBps_of_min_bytes"] = rec["fwd_min_bytes"] / rec["fwd_ms"] / 1e6
                if rec.get("fwd_flops") and rec.get("fwd_ms"):
                    rec["fwd_TFLOPs"] = rec["fwd_flops"] / rec["fwd_ms"] / 1e9
                results.append(rec)
                print(json.dumps(rec), flush=True)
                save(meta, results, args.json)
            del rows
            torch.cuda.empty_cache()
    save(meta, results, args.json)
    report(meta, results, args.plot)
    return 0


def save(meta: dict, results: list, path: str) -> None:
    """Write the JSON (after every row too: a run stopped by a time limit keeps what it measured)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
