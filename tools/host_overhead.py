"""Where the host's time goes in a short-sequence ASA step (one GPU).

    python tools/host_overhead.py --json host.json

At 2K tokens ASA's kernels take ≈ 0.2 ms fwd+bwd but a call takes ≈ 1 ms of wall time: the host
(Python, autograd, allocations, Triton's launch path) is the bound. This measures its parts
without a profiler (cProfile inflates every Python call):

* ``step_us``: wall time per fwd+bwd of ``ops.asa_attention`` (and of cuDNN SDPA for scale) at a
  length where the GPU work is negligible (T = 128), queued back to back, one sync at the end;
* ``jit_launch_us``: one ``kernel[grid](...)`` of the r kernel (6 arguments) and of the output
  kernel (≈ 30 arguments) — Triton's binder, specialisation key, cache lookup and launcher;
* ``direct_launch_us``: the same compiled kernels launched through their ``CompiledKernel``
  handle (no binder, no key), the floor a launch cache could reach;
* ``empty_us``: one ``torch.empty`` from the caching allocator.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time

import torch
import triton


def _per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def _attribute(asa_fn, step, calls: int) -> dict:
    """Host µs per ``step`` spent inside each Triton launch and helper of
    kernels/asa/function.py and inside ``ASAChunkFunction.forward`` / ``.backward`` (inclusive
    times; a helper's own launches count in both), measured by wrapping them for the duration."""
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    totals: dict = {}
    patched = []

    def timed(name, fn):
        totals[name] = 0

        def wrapper(*a, **kw):
            start = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += time.perf_counter_ns() - start
        return wrapper

    class TimedKernel:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel
            totals[name] = 0

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*a, **kw):
                start = time.perf_counter_ns()
                launch(*a, **kw)
                totals[self.name] += time.perf_counter_ns() - start
            return run

    for name, obj in list(vars(asa_fn).items()):
        if isinstance(obj, JITFunction):
            patched.append((asa_fn, name, obj))
            setattr(asa_fn, name, TimedKernel(f"launch {name}", obj))
        elif callable(obj) and name in (
                "launch_config", "_chunk_states", "_chunk_delta", "_scan_pair", "_reverse_states",
                "_linear_r", "_param_grad"):
            patched.append((asa_fn, name, obj))
            setattr(asa_fn, name, timed(name, obj))
    cls = asa_fn.ASAChunkFunction
    for meth in ("forward", "backward"):
        fn = cls.__dict__[meth].__func__
        patched.append((cls, meth, cls.__dict__[meth]))
        setattr(cls, meth, staticmethod(timed(f"ASAChunkFunction.{meth}", fn)))
    try:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        for key in totals:
            totals[key] = 0
        start = time.perf_counter_ns()
        for _ in range(calls):
            step()
        wall = time.perf_counter_ns() - start
        torch.cuda.synchronize()
    finally:
        for owner, name, obj in patched:
            setattr(owner, name, obj)
    out = {"attr_us[step wall, T=128]": wall / calls / 1e3}
    out.update({f"attr_us[{k}]": v / calls / 1e3 for k, v in sorted(totals.items())})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.nn.functional as F  # noqa: PLC0415

    from megatron_subq.kernels.asa import chunk as asa_chunk  # noqa: PLC0415
    from megatron_subq.kernels.asa import function as asa_fn  # noqa: PLC0415
    from megatron_subq.ops import asa_attention  # noqa: PLC0415

    res: dict = {"gpu": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                 "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                 "triton": triton.__version__, "torch": torch.__version__}
    B, H, D, m = 1, 16, 128, 64
    dt = torch.bfloat16
    for T in (128, 2048):
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dt, requires_grad=True)
                   for _ in range(3))
        p_q, p_k = (torch.randn(H, D, m, device="cuda", dtype=dt, requires_grad=True)
                    for _ in range(2))
        g = torch.randn(B, T, H, D, device="cuda", dtype=dt)

        def asa_fwd():
            with torch.no_grad():
                asa_attention(q, k, v, p_q, p_k, "linear")

        def asa_step():
            asa_attention(q, k, v, p_q, p_k, "linear").backward(g)

        qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

        def sdpa_step():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
                out.backward(g.transpose(1, 2))

        for name, fn in (("asa_fwd", asa_fwd), ("asa_fwd_bwd", asa_step),
                         ("cudnn_fwd_bwd", sdpa_step)):
            res[f"step_us[{name},T={T}]"] = _per_call_us(fn, args.calls)

    # single launches: the r kernel (few arguments) and the output kernel (many)
    T = 128
    cfg = asa_fn.launch_config(D, m, D, dt)
    o = torch.randn(B, T, H, D, device="cuda", dtype=dt)
    den = torch.rand(B, H, T, device="cuda") + 1
    r = torch.empty_like(den)
    grid_r = (triton.cdiv(T, cfg.BT), B * H)
    r_args = (g[:, :T], o, den, r, T, H, D)
    r_const = dict(BT=cfg.BT, BV=asa_fn._pow2(D), num_warps=4)

    def jit_r():
        asa_chunk.asa_bwd_r_kernel[grid_r](*r_args, **r_const)

    res["jit_launch_us[r]"] = _per_call_us(jit_r, args.calls * 4)
    try:  # CompiledKernel's runner takes every kernel argument, constexprs included
        compiled = asa_chunk.asa_bwd_r_kernel.warmup(*r_args, grid=grid_r, **r_const)
        runner = compiled[grid_r + (1,)]  # a compiled kernel's grid has three dimensions
        const_vals = (cfg.BT, asa_fn._pow2(D))
        res["direct_launch_us[r]"] = _per_call_us(lambda: runner(*r_args, *const_vals),
                                                  args.calls * 4)
    except Exception as exc:  # an internal API: record, do not stop
        res["direct_launch_us[r]"] = f"failed: {exc!r}"

    q = torch.randn(B, T, H, D, device="cuda", dtype=dt)
    k, v = torch.randn_like(q), torch.randn_like(q)
    p_q = torch.randn(H, D, m, device="cuda", dtype=dt)
    p_k = torch.randn_like(p_q)
    states, zs, _ = asa_fn._chunk_states(k, v, p_k, None, None, cfg, H, 1, False)
    NT = states.shape[2]
    out = torch.empty_like(q)
    grid_o = (NT, triton.cdiv(D, cfg.BV_out), B * H)
    o_args = (q, k, v, p_q, p_k, states, zs, den, out, den, den, T, H, 1, D, m, D, NT,
              q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
              v.stride(0), v.stride(1), v.stride(2))
    o_const = dict(BT=cfg.BT, RB=cfg.out_rows, BD=cfg.BD, BDT=cfg.BDT, BM=cfg.BM, BV=cfg.BV_out,
                   NORM=0,
                   PREC=cfg.PREC, VARLEN=False)
    launch = dict(num_warps=cfg.out_warps, num_stages=cfg.stages)

    def jit_o():
        asa_chunk.asa_fwd_out_kernel[grid_o](*o_args, **o_const, **launch)

    res["jit_launch_us[out]"] = _per_call_us(jit_o, args.calls * 4)
    try:
        compiled = asa_chunk.asa_fwd_out_kernel.warmup(*o_args, grid=grid_o, **o_const,
                                                          **launch)
        runner_o = compiled[grid_o]
        o_vals = tuple(o_const.values())
        res["direct_launch_us[out]"] = _per_call_us(lambda: runner_o(*o_args, *o_vals),
                                                    args.calls * 4)
    except Exception as exc:
        res["direct_launch_us[out]"] = f"failed: {exc!r}"
    # the backward's parts, each alone (T = 128: the GPU work is negligible)
    kq, kk, kv = (torch.randn(B, T, H, D, device="cuda", dtype=dt, requires_grad=True)
                  for _ in range(3))
    kp_q, kp_k = (torch.randn(H, D, m, device="cuda", dtype=dt, requires_grad=True)
                  for _ in range(2))
    leaves = (kq, kk, kv, kp_q, kp_k)
    g = torch.randn(B, T, H, D, device="cuda", dtype=dt)

    def fn_apply():
        return asa_fn.ASAChunkFunction.apply(kq, kk, kv, kp_q, kp_k, "linear", None, None,
                                             False, None)[0]

    res["part_us[ASAChunkFunction fwd]"] = _per_call_us(
        lambda: fn_apply().detach(), args.calls)
    res["part_us[ASAChunkFunction fwd+grad]"] = _per_call_us(
        lambda: torch.autograd.grad(fn_apply(), leaves, g), args.calls)
    o_saved = fn_apply().detach()
    r_saved = asa_fn._linear_r(g, o_saved, den, cfg)
    res["part_us[_linear_r]"] = _per_call_us(lambda: asa_fn._linear_r(g, o_saved, den, cfg),
                                             args.calls)
    res["part_us[_reverse_states]"] = _per_call_us(
        lambda: asa_fn._reverse_states(q, p_q, g, den, r_saved, cfg, 0, NT), args.calls)
    res["part_us[_param_grad]"] = _per_call_us(
        lambda: asa_fn._param_grad(q, torch.empty(B, T, H, m, device="cuda", dtype=dt), 1, cfg),
        args.calls)

    class Identity(torch.autograd.Function):  # the autograd engine's own cost, for scale
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, d):
            return d

    res["part_us[autograd identity fwd+grad]"] = _per_call_us(
        lambda: torch.autograd.grad(Identity.apply(kq), (kq,), g), args.calls)
    res.update(_attribute(asa_fn, lambda: torch.autograd.grad(fn_apply(), leaves, g),
                          args.calls))
    res["empty_us"] = _per_call_us(lambda: torch.empty(B, T, H, D, device="cuda", dtype=dt),
                                   args.calls * 4)
    for key, val in res.items():
        print(f"{key:40s} {val:.1f}" if isinstance(val, float) else f"{key:40s} {val}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
