"""Where the host's time goes in a short-sequence ASA step (one GPU).

    python tools/host_overhead.py --json host.json

At 2K tokens ASA's kernels take ≈ 0.2 ms fwd+bwd but a call takes ≈ 1 ms of wall time: the host
(Python, autograd, allocations, Triton's launch path) is the bound. This measures its parts
without a profiler (cProfile inflates every Python call):

* ``step_us``: wall time per fwd+bwd of ``ops.asa_attention`` (and of cuDNN SDPA for scale) at
  T = 128 and 2048 (the GPU work is negligible), queued back to back, one sync at the end;
  ``split_us``: the same step's forward and ``.backward`` apart;
* ``jit_launch_us`` / ``fast_launch_us``: one launch of the r kernel through Triton's binder
  (``kernel[grid](...)``) and through ``kernels/launch.py``'s ``fast``;
* ``part_us``: the backward's helpers alone; ``attr_us``: host time inside each helper, each
  ``fast`` launch and the Function's forward / backward during a step (inclusive times);
* ``empty_us``: one ``torch.empty`` from the caching allocator;
* ``--trace PATH``: a torch.profiler Chrome trace of bench_ops' eager step at 2K and its host
  timeline per thread (the backward runs on the autograd engine's device thread).
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

    from megatron_subq.kernels import launch as launch_mod  # noqa: PLC0415

    def timed_launches(owner, attr, kernel_of):
        """``owner.attr`` (a launch method) timed per kernel name (``kernel_of(self)``)."""
        plain = getattr(owner, attr)

        def wrapper(self, *a, **kw):
            kernel = kernel_of(self)
            name = f"launch {getattr(getattr(kernel, 'fn', kernel), '__name__', '?')}"
            start = time.perf_counter_ns()
            try:
                return plain(self, *a, **kw)
            finally:
                totals[name] = totals.get(name, 0) + time.perf_counter_ns() - start
        patched.append((owner, attr, plain))
        setattr(owner, attr, wrapper)

    # every fast(kernel)[grid](...) and every bound launch (launch.Bound) of the step
    timed_launches(launch_mod.FastLaunch, "launch", lambda f: f.kernel)
    timed_launches(launch_mod.Bound, "__call__", lambda b: b.owner.kernel)
    for name, obj in list(vars(asa_fn).items()):
        if isinstance(obj, JITFunction):
            continue  # launched through fast(): timed above
        if callable(obj) and name in (
                "launch_config", "_chunk_states", "_chunk_delta", "_scan_pair", "_reverse_states",
                "_linear_r", "_param_grads", "_empty_rows", "_like_rows", "chunk_table"):
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


def _split_us(forward, leaves, grad, calls: int) -> dict:
    """Host µs per call of the forward (autograd on) and of its ``.backward(grad)`` (which
    returns when the autograd engine's device thread is done), the leaves' grads reset between
    calls as ``bench_ops`` does; the GPU is idle-bound at short lengths, so this is host time."""
    fwd = bwd = 0
    for i in range(calls + 10):
        t0 = time.perf_counter_ns()
        out = forward()
        t1 = time.perf_counter_ns()
        out.backward(grad)
        t2 = time.perf_counter_ns()
        for x in leaves:
            x.grad = None
        if i >= 10:
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    torch.cuda.synchronize()
    return {"forward": fwd / calls / 1e3, "backward": bwd / calls / 1e3}


def _phases(asa_fn, forward, leaves, grad, calls: int) -> dict:
    """Mean host µs between timestamps of one bench-style step: the call, the Function's
    forward entry / exit, the op's return, the Function's backward entry / exit (on the autograd
    engine's device thread), ``.backward`` returning, the grads reset. ``"handoff"``: from the
    op's return to the backward's entry (``torch.autograd.backward``'s Python, the engine's
    graph walk and the wake-up of its device thread) and from the backward's exit to
    ``.backward`` returning (the grads' accumulation and the caller's wake-up)."""
    cls = asa_fn.ASAChunkFunction
    stamps: dict = {}
    originals = {m: cls.__dict__[m] for m in ("forward", "backward")}

    def stamped(name, fn):
        def wrapper(*a, **kw):
            stamps[name + " in"] = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                stamps[name + " out"] = time.perf_counter_ns()
        return staticmethod(wrapper)

    for m, orig in originals.items():
        setattr(cls, m, stamped(m, orig.__func__))
    order = ("call", "forward in", "forward out", "return", "backward in", "backward out",
             "backward returned", "reset")
    sums = dict.fromkeys(order[1:], 0)
    try:
        for i in range(calls + 10):
            stamps["call"] = time.perf_counter_ns()
            out = forward()
            stamps["return"] = time.perf_counter_ns()
            out.backward(grad)
            stamps["backward returned"] = time.perf_counter_ns()
            for x in leaves:
                x.grad = None
            stamps["reset"] = time.perf_counter_ns()
            if i >= 10:
                for a, b in zip(order, order[1:]):
                    sums[b] += stamps[b] - stamps[a]
        torch.cuda.synchronize()
    finally:
        for m, orig in originals.items():
            setattr(cls, m, orig)
    return {f"{a} -> {b}": sums[b] / calls / 1e3 for a, b in zip(order, order[1:])}


def _trace(step, path: str, steps: int = 3) -> dict:
    """torch.profiler (CPU + CUDA) of ``steps`` back-to-back calls of ``step``, each in a
    ``step`` range: the Chrome trace at ``path``, and per thread the last step's top-level host
    events (start offset and duration, µs) — where the host time goes, the autograd engine's
    device thread included (cProfile sees only the calling thread)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("step"):
                step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    last = max((e for e in events if e["name"] == "step" and e.get("cat") == "user_annotation"),
               key=lambda e: e["ts"])
    t0, t1 = last["ts"], last["ts"] + last["dur"]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime",
                                                   "cuda_driver", "python_function")
            and t0 <= e["ts"] <= t1]
    out: dict = {"step_us": last["dur"]}
    for tid in sorted({e["tid"] for e in host}, key=str):
        mine = sorted((e for e in host if e["tid"] == tid and e is not last),
                      key=lambda e: (e["ts"], -e["dur"]))
        top, end = [], -1.0
        for e in mine:  # top level: not inside the previous top-level event
            if e["ts"] >= end:
                top.append(e)
                end = e["ts"] + e["dur"]
        launches = sum(e["dur"] for e in mine if "aunch" in e["name"])
        print(f"thread {tid}: {len(top)} top-level events, {sum(e['dur'] for e in top):.0f} us "
              f"busy of the step's {last['dur']:.0f} us; {launches:.0f} us in kernel launches",
              flush=True)
        for e in top:
            print(f"  +{e['ts'] - t0:8.1f} {e['dur']:8.1f} us  {e['name'][:90]}", flush=True)
        out[f"thread {tid}"] = [(round(e["ts"] - t0, 1), round(e["dur"], 1), e["name"][:90])
                                for e in top]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--json", default="")
    parser.add_argument("--trace", default="", metavar="PATH",
                        help="also write a torch.profiler Chrome trace (CPU + CUDA) of the "
                             "eager fwd+bwd at T=2048 here and print its host timeline")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.nn.functional as F  # noqa: PLC0415

    from megatron_subq.kernels.asa import chunk as asa_chunk  # noqa: PLC0415
    from megatron_subq.kernels.asa import function as asa_fn  # noqa: PLC0415
    from megatron_subq.kernels.launch import fast  # noqa: PLC0415
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
        leaves = (q, k, v, p_q, p_k)
        split = _split_us(lambda: asa_attention(q, k, v, p_q, p_k, "linear"), leaves, g,
                          args.calls)
        res.update({f"split_us[asa {part},T={T}]": us for part, us in split.items()})

        def bench_step():  # bench_ops' fwd_bwd: the grads reset after each call
            asa_attention(q, k, v, p_q, p_k, "linear").backward(g)
            for x in leaves:
                x.grad = None

        for threads in (True, False):  # the backward on the engine's device thread, or here
            with torch.autograd.set_multithreading_enabled(threads):
                phases = _phases(asa_fn, lambda: asa_attention(q, k, v, p_q, p_k, "linear"),
                                 leaves, g, args.calls)
            tag = "engine thread" if threads else "calling thread"
            res.update({f"phase_us[{name},{tag},T={T}]": us for name, us in phases.items()})
            with torch.autograd.set_multithreading_enabled(threads):
                res[f"step_us[asa bench step,{tag},T={T}]"] = _per_call_us(bench_step,
                                                                           args.calls)
                res[f"step_us[cudnn_fwd_bwd,{tag},T={T}]"] = _per_call_us(sdpa_step,
                                                                          args.calls)
        if args.trace and T == 2048:
            res["trace"] = _trace(bench_step, args.trace)

    # one launch of the r kernel (7 arguments): Triton's binder against kernels/launch.py's fast
    T = 128
    cfg = asa_fn.launch_config(D, m, D, dt)
    o = torch.randn(B, T, H, D, device="cuda", dtype=dt)
    den = torch.rand(B, H, T, device="cuda") + 1
    r = torch.empty_like(den)
    grid_r = (triton.cdiv(T, cfg.BT), B * H)
    r_kw = dict(do_ptr=g[:, :T], o_ptr=o, den_ptr=den, r_ptr=r, T=T, H=H, DV=D, BT=cfg.BT,
                BV=asa_fn._pow2(D), B=B, TMAJOR=False, num_warps=4)
    res["jit_launch_us[r]"] = _per_call_us(
        lambda: asa_chunk.asa_bwd_r_kernel[grid_r](**r_kw), args.calls * 4)
    res["fast_launch_us[r]"] = _per_call_us(
        lambda: fast(asa_chunk.asa_bwd_r_kernel)[grid_r](**r_kw), args.calls * 4)
    q = torch.randn(B, T, H, D, device="cuda", dtype=dt)
    p_q = torch.randn(H, D, m, device="cuda", dtype=dt)
    NT = triton.cdiv(T, cfg.BT)
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
    dl = torch.empty(B, T, H, m, device="cuda", dtype=dt)
    res["part_us[_param_grads]"] = _per_call_us(
        lambda: asa_fn._param_grads(q, q, dl, dl, 1, cfg, dt),
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
