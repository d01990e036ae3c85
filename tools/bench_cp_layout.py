#!/usr/bin/env python
"""What context parallelism's all-to-all path adds around an op, on one device: the layout work.

    python tools/bench_cp_layout.py [--seq 65536] [--heads 16] [--kv-heads N] [--head-dim 128]
        [--cp 2 4] [--variants standard asa superlinear] [--device cuda|cpu] [--json FILE]
        [--state-passing [asa approx nonapprox]] [--profile [STEPS]]

Per CP size, one rank's share of the exchange around ``attend`` (megatron_subq/attention.py):
``qkv_sequence_to_heads`` on q, k, v and ``heads_to_sequence`` on the output, forward and
backward ("packed", the current path), and the same through the pre-issue-24 path
(megatron_subq/testing/cp_reference.py: three ``sequence_to_heads``, ``heads_to_sequence``;
"reference"), against the op it wraps, forward and backward, on the ``[1, seq, heads/cp,
head_dim]`` tensors that rank attends (bf16; GPU only). The stand-in for ``attend`` passes q
through and backward feeds given gradients to q, k and v (no arithmetic in the number).

One process, one device: the exchange is simulated by local copies of the same bytes (the
reference's ``all_to_all_single`` a clone of its buffer, the packed path's transfer one copy
per message to a peer; the simulated rank is rank 0), so the interconnect is not in the
number; the permutation work is, which is what runs on every GPU whatever the interconnect.
Also counted, per path and direction, on the same tensors: the kernels that write memory
(aten ops other than views; a transfer counts as one, as NCCL groups it) and the bytes they
write in units of q + k + v + output ("passes per tensor"; a transfer counts the bytes it
delivers: the reference's all-to-all its whole buffer, own slice included, as NCCL copies it).
CUDA events, median of --repeats after a warm-up: the device's time (the GPU busy first while
the host enqueues, so launch overhead is hidden) and the eager time (as a step runs it).
``--device cpu``: the layout only, wall-clock medians (a rough before/after at small sizes).
Prints one line per measurement, a JSON document (and --json FILE) and markdown rows.

``--state-passing [VARIANT ...]`` (asa, approx, nonapprox; none named: asa) adds, per CP size,
the other CP scheme (``context_parallel_scheme="state_passing"``) on one rank, forward and
backward: the variant's real core attention (built in a world of one, megatron's parallel state
from ``init_single_process``; its CP size and rank then set to N and 0) runs
``SubqCoreAttention._attend_state_passing`` on the rank's two zig-zag chunks of seq/(2N) tokens
with every head (state passing keeps heads whole): ``chunk_state`` of both, the all-gather
(simulated: the own states stacked N times, the bytes it delivers), ``states_before`` and
``attend_from_state`` of both, gradients to q, k, v and the core's parameters. Against it, the
all-to-all path on the same rank: the packed layout measured above plus the same variant's core
``attend`` on ``[1, seq, heads/N, head_dim]`` (forward and backward, the same config), and the
ratio state passing / all-to-all. On the GPU both in device and eager time; ``--device cpu``
too (wall clock). Printed per measurement, in the JSON's ``state_passing_rows`` and as a second
markdown table; the layout rows and the other output are unchanged. For the H200 numbers::

    python tools/bench_cp_layout.py --cp 2 4 --variants asa --state-passing asa approx nonapprox

``--profile [STEPS]`` (with ``--state-passing``; default 3 steps): after the timings, per CP size
and variant, ``torch.profiler`` over STEPS forward + backward steps of the state passing and of
the all-to-all path's op (after one warm-up step each), printing the top 15 kernels by device
time per step (on the GPU the CUDA kernels; ``--device cpu`` the CPU ops by self time), into the
log and the row's ``profile`` in the JSON: where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def _op(variant, heads, d, seq, dev):
    from megatron_subq import ops

    dt = torch.bfloat16
    q, k, v = (torch.randn(1, seq, heads, d, device=dev, dtype=dt, requires_grad=True)
               for _ in range(3))
    if variant == "standard":
        return lambda: ops.standard_attention(q, k, v), (q, k, v)
    if variant == "asa":
        m = 64
        p_q, p_k = ((torch.randn(heads, d, m, device=dev, dtype=dt) / d ** .5).requires_grad_()
                    for _ in range(2))
        return lambda: ops.asa_attention(q, k, v, p_q, p_k), (q, k, v, p_q, p_k)
    if variant == "superlinear":
        q_s = torch.randn_like(q, requires_grad=True)
        return lambda: ops.superlinear_attention(q, q_s, k, v), (q, q_s, k, v)
    raise SystemExit(f"--variants: {variant} is not one of standard, asa, superlinear")


_COUNTER = None  # the _WriteCounter active, if any


class _WriteCounter(TorchDispatchMode):
    """Counts the aten ops that produce new memory (views and metadata ops excluded) and the
    bytes of their outputs."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __enter__(self):
        global _COUNTER
        _COUNTER = self
        return super().__enter__()

    def __exit__(self, *exc):
        global _COUNTER
        _COUNTER = None
        return super().__exit__(*exc)

    # ops that only make views or allocate without writing
    METADATA = {"view", "_unsafe_view", "_reshape_alias", "reshape", "permute", "transpose",
                "t", "expand", "slice", "select", "narrow", "unsqueeze", "squeeze", "alias",
                "detach", "as_strided", "split", "split_with_sizes", "unbind", "empty",
                "new_empty", "empty_like", "empty_strided", "new_empty_strided"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.METADATA:
            return out
        written = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                   if isinstance(t, torch.Tensor)]
        if written:
            self.kernels += 1
            self.bytes += sum(t.numel() * t.element_size() for t in written)
        return out


def _layouts(cp, local, heads, kv_heads, d, dev, dt):
    """(name -> (forward, backward)) for the two paths, on fresh leaf tensors; each forward
    returns what its backward needs."""
    from megatron_subq import attention
    from megatron_subq.testing import cp_reference

    def leaves():
        return [torch.randn(local, 1, n, d, device=dev, dtype=dt, requires_grad=True)
                for n in (heads, kv_heads, kv_heads)]

    def grads(outs):
        return [torch.ones_like(x) for x in outs]

    qkv = leaves()

    def packed_fwd():
        q, k, v = attention.qkv_sequence_to_heads(*qkv, None, 1, cp, 0)
        return [attention.heads_to_sequence(q, None, cp, 0), k, v]

    def reference_fwd():
        q = cp_reference.sequence_to_heads(qkv[0], None)
        k, v = (cp_reference.sequence_to_heads(cp_reference.replicate_kv_heads(x, cp), None)
                for x in qkv[1:])
        return [cp_reference.heads_to_sequence(q, None), k, v]

    def backward(outs, gs):
        torch.autograd.backward(outs, gs)

    return qkv, {"packed": packed_fwd, "reference": reference_fwd}, backward, grads


def _simulated(cp):
    """Patches standing in for the other ranks: the reference's all_to_all a clone, the packed
    path's transfer a copy per message."""
    from megatron_subq import attention
    from megatron_subq.testing import cp_reference

    def transfer(sends, recvs, group):
        """Copies of the messages' sizes, counted as one kernel (NCCL's grouped send/recv)."""
        for (dst, _), (src, _) in zip(recvs, sends):
            if _COUNTER is None:
                dst.copy_(src)
            else:
                with torch.utils._python_dispatch._disable_current_modes():
                    dst.copy_(src)
                _COUNTER.bytes += dst.numel() * dst.element_size()
        if _COUNTER is not None and sends:
            _COUNTER.kernels += 1

    return [mock.patch.object(cp_reference, "get_pg_size", lambda group: cp),
            mock.patch.object(cp_reference._AllToAll, "apply",
                              staticmethod(lambda x, group: x.contiguous().clone())),
            mock.patch.object(attention, "_transfer", transfer)]


def _cpu_median_ms(fn, warmup=2, repeat=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


STATE_PASSING_VARIANTS = ("asa", "approx", "nonapprox")


def _core(variant, heads, kv_heads, d, dev, dt):
    """The variant's real core attention (``SubqCoreAttention``) for ``heads`` query and
    ``kv_heads`` key/value heads, built at CP = 1 in the world of one, its parameters in ``dt``
    on ``dev``."""
    from megatron_subq import SubqTransformerConfig
    from megatron_subq.variants.approx import ApproxCoreAttention
    from megatron_subq.variants.asa import ASACoreAttention
    from megatron_subq.variants.nonapprox import NonapproxCoreAttention

    core_cls = {"asa": ASACoreAttention, "approx": ApproxCoreAttention,
                "nonapprox": NonapproxCoreAttention}[variant]
    cfg = SubqTransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                                num_query_groups=kv_heads, kv_channels=d,
                                attention_variant=variant, params_dtype=dt,
                                use_cpu_initialization=dev.type == "cpu")
    return core_cls(cfg, layer_number=1).to(device=dev, dtype=dt)


def _state_passing(variant, cp, seq, heads, kv_heads, d, dev, dt):
    """(step, leaves, core, state bytes): one CP rank's forward + backward through the real
    ``SubqCoreAttention._attend_state_passing`` of ``variant``'s core (heads whole; rank 0's two
    zig-zag chunks of seq / (2 cp) tokens: ``chunk_state`` of both, the all-gather,
    ``states_before``, ``attend_from_state`` of both), with gradients to q, k, v and the core's
    parameters. The all-gather is simulated: the own states stacked ``cp`` times (the bytes the
    gather delivers; its backward sums the ``cp`` slots' gradients, as the all-reduce does)."""
    from megatron_subq import attention

    core = _core(variant, heads, kv_heads, d, dev, dt)
    core.cp_size, core.cp_rank, core.cp_mode = cp, 0, "state_passing"
    local = seq // cp
    qkv = [torch.randn(1, local, n, d, device=dev, dtype=dt, requires_grad=True)
           for n in (heads, kv_heads, kv_heads)]
    params = list(core.parameters())
    with torch.no_grad():
        c = local // 2
        state_bytes = sum(t.numel() * t.element_size()
                          for t in core.chunk_state(qkv[0][:, :c], qkv[1][:, :c], qkv[2][:, :c]))

    def gather(x, group):
        return torch.stack([x] * cp)

    def step():
        for x in qkv + params:  # no accumulation pass into .grad
            x.grad = None
        with mock.patch.object(attention._AllGather, "apply", staticmethod(gather)):
            out = core._attend_state_passing(*qkv)
        out.backward(torch.ones_like(out))

    return step, qkv, core, 2 * state_bytes


def _all_to_all_op(variant, cp, seq, heads, kv_heads, d, dev, dt):
    """The op the all-to-all path runs on this rank after the exchange: the same variant's core
    ``attend`` on ``[1, seq, heads / cp, d]`` (key/value heads split, or one replicated),
    forward + backward with gradients to q, k, v and the core's parameters."""
    kv_local = kv_heads // cp if kv_heads % cp == 0 else 1
    core = _core(variant, heads // cp, kv_local, d, dev, dt)
    qkv = [torch.randn(1, seq, n, d, device=dev, dtype=dt, requires_grad=True)
           for n in (heads // cp, kv_local, kv_local)]
    params = list(core.parameters())

    def step():
        for x in qkv + params:
            x.grad = None
        out = core.attend(*qkv)
        out.backward(torch.ones_like(out))

    return step, qkv, core


PROFILE_TOP = 15


def _profile(fn, steps, gpu, top=PROFILE_TOP):
    """``torch.profiler`` over ``steps`` calls of ``fn`` (after one warm-up call): the ``top``
    kernels by self device time (GPU: the CUDA kernels; CPU: the ops by self CPU time), each
    ``{"name", "calls", "ms_per_step", "share"}`` (share of the listed kind's total), and that
    total per step."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if gpu:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if gpu:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if gpu:
        # kernels (and memcpy/memset) run on the device: their own time is device time; the
        # aten ops that launched them carry it too, so keep the device-side entries only
        cuda = torch.autograd.DeviceType.CUDA
        kernels = [e for e in events if getattr(e, "device_type", None) == cuda]

        def us(e):  # self_cuda_time_total before torch 2.4
            return getattr(e, "self_device_time_total", None) or getattr(
                e, "self_cuda_time_total", 0)

        kernels = kernels or [e for e in events if us(e) > 0]
    else:
        kernels = [e for e in events if e.self_cpu_time_total > 0]

        def us(e):
            return e.self_cpu_time_total
    total = sum(us(e) for e in kernels)
    kernels.sort(key=us, reverse=True)
    return {"steps": steps, "kind": "cuda kernels" if gpu else "cpu ops",
            "total_ms_per_step": round(total / 1e3 / steps, 4),
            "top": [{"name": e.key, "calls": e.count // steps if steps else e.count,
                     "ms_per_step": round(us(e) / 1e3 / steps, 4),
                     "share": round(us(e) / total, 4) if total else 0.0}
                    for e in kernels[:top]]}


def _print_profile(cp, variant, path, prof):
    print(f"cp {cp}  profile {variant} {path}: {prof['kind']}, "
          f"{prof['total_ms_per_step']:.3f} ms per step in all; top {len(prof['top'])}:",
          flush=True)
    for e in prof["top"]:
        print(f"    {e['ms_per_step']:9.3f} ms {100 * e['share']:5.1f}%  x{e['calls']:<4d} "
              f"{e['name'][:110]}", flush=True)


def _state_passing_rows(a, cp, kv, variants, layout, dev, dt, gpu):
    """Per variant: one rank's state passing against its all-to-all path (the packed layout
    just measured + the op on heads/cp), both forward + backward."""
    if gpu:
        from tools.gpu_timing import median_ms

        def timed(fn):
            return median_ms(fn, repeat=a.repeats, queue_full=True), median_ms(fn, repeat=a.repeats)
    else:
        def timed(fn):
            ms = _cpu_median_ms(fn, repeat=a.repeats)
            return ms, ms
    rows = []
    for variant in variants:
        torch.manual_seed(0)
        step, qkv, core, state_bytes = _state_passing(variant, cp, a.seq, a.heads, kv,
                                                      a.head_dim, dev, dt)
        sp_ms, sp_eager = timed(step)
        profiles = {}
        if a.profile:
            profiles["state_passing"] = _profile(step, a.profile, gpu)
            _print_profile(cp, variant, "state passing", profiles["state_passing"])
        del step, qkv, core
        step, qkv, core = _all_to_all_op(variant, cp, a.seq, a.heads, kv, a.head_dim, dev, dt)
        op_ms, op_eager = timed(step)
        if a.profile:
            profiles["all_to_all_op"] = _profile(step, a.profile, gpu)
            _print_profile(cp, variant, f"all-to-all op on h/{cp}", profiles["all_to_all_op"])
        impl = core.config.subq_impl
        del step, qkv, core
        if gpu:
            torch.cuda.empty_cache()
        a2a = layout["packed"]["ms"] + op_ms
        a2a_eager = layout["packed"]["eager_ms"] + op_eager
        rows.append({"cp": cp, "variant": variant, "seq": a.seq, "heads": a.heads,
                     "kv_heads": kv, "head_dim": a.head_dim, "chunk_tokens": a.seq // (2 * cp),
                     "device": a.device, "subq_impl": impl, "own_state_bytes": state_bytes,
                     "gathered_state_bytes": cp * state_bytes,
                     "state_passing_ms": round(sp_ms, 3),
                     "state_passing_eager_ms": round(sp_eager, 3),
                     "layout_ms": round(layout["packed"]["ms"], 3),
                     "all_to_all_op_ms": round(op_ms, 3),
                     "all_to_all_op_eager_ms": round(op_eager, 3),
                     "all_to_all_ms": round(a2a, 3), "all_to_all_eager_ms": round(a2a_eager, 3),
                     "ratio": round(sp_ms / a2a, 4), "eager_ratio": round(sp_eager / a2a_eager, 4)})
        if profiles:
            rows[-1]["profile"] = profiles
        print(f"cp {cp}  state passing {variant:<9} {'device' if gpu else 'cpu'} time "
              f"{sp_ms:8.2f} ms (eager {sp_eager:8.2f}) | all-to-all: layout "
              f"{layout['packed']['ms']:6.2f} + op on h/{cp} {op_ms:8.2f} = {a2a:8.2f} ms "
              f"(eager {a2a_eager:8.2f}) | state passing / all-to-all {sp_ms / a2a:5.2f}",
              flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16, help="heads per TP rank before the split")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads per TP rank (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--variants", nargs="*", default=["standard", "asa", "superlinear"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--state-passing", nargs="*", default=None, metavar="VARIANT",
                   help="also time one CP rank's state passing (heads whole) against the "
                        "all-to-all path (layout + the op on heads/cp) for these variants "
                        f"(of {', '.join(STATE_PASSING_VARIANTS)}; none named: asa)")
    p.add_argument("--profile", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                   help="with --state-passing: torch.profiler over STEPS (default 3) steps of "
                        "the state passing and of the all-to-all op, the top "
                        f"{PROFILE_TOP} kernels by device time per variant (log and JSON)")
    a = p.parse_args(argv)
    kv = a.kv_heads or a.heads
    if a.profile and a.state_passing is None:
        raise SystemExit("--profile profiles the --state-passing steps: name --state-passing too")
    if a.profile < 0:
        raise SystemExit(f"--profile {a.profile}: a number of steps >= 1")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_cp_layout.py --device cuda needs a CUDA GPU (--device cpu: the "
                         "layout only)")
    for cp in a.cp:
        if cp < 2 or a.heads % cp or a.seq % (2 * cp) or (kv % cp and cp % kv):
            raise SystemExit(f"--cp {cp}: needs cp >= 2 dividing --heads {a.heads}, 2 x cp "
                             f"dividing --seq {a.seq}, and a divisor or multiple of --kv-heads")
    sp_variants = None
    if a.state_passing is not None:
        sp_variants = a.state_passing or ["asa"]
        for name in sp_variants:
            if name not in STATE_PASSING_VARIANTS:
                raise SystemExit(f"--state-passing: {name} is not one of "
                                 f"{', '.join(STATE_PASSING_VARIANTS)}")
        for cp in a.cp:
            if a.seq % (2 * cp) or (a.seq // (2 * cp)) < 1:
                raise SystemExit(f"--state-passing: --seq {a.seq} is not 2 x {cp} chunks")
        from megatron_subq import init_single_process

        ours = not torch.distributed.is_initialized()  # torn down at the end only if ours
        init_single_process()
    from contextlib import ExitStack

    gpu = a.device == "cuda"
    dev = torch.device(a.device)
    dt = torch.bfloat16 if gpu else torch.float32
    if gpu:
        from tools.gpu_timing import median_ms
    rows, sp_rows = [], []
    for cp in a.cp:
        local = a.seq // cp
        layout = {}
        with ExitStack() as stack:
            for patch in _simulated(cp):
                stack.enter_context(patch)
            qkv, paths, backward, grads = _layouts(cp, local, a.heads, kv, a.head_dim, dev, dt)
            unit = sum(x.numel() for x in qkv) + qkv[0].numel()  # q, k, v and the output
            for name, fwd in paths.items():
                outs = fwd()
                gs = grads(outs)
                counts = {}
                for x in qkv:
                    x.grad = None
                for direction in ("fwd", "bwd"):
                    with _WriteCounter() as c:
                        if direction == "fwd":
                            outs = fwd()
                        else:
                            backward(outs, gs)
                    counts[direction] = (c.kernels, round(c.bytes / (unit * dt.itemsize), 2))

                def step(fwd=fwd, gs=gs):
                    for x in qkv:  # no accumulation pass into .grad
                        x.grad = None
                    backward(fwd(), gs)

                if gpu:
                    ms = median_ms(step, repeat=a.repeats, queue_full=True)
                    eager = median_ms(step, repeat=a.repeats)
                else:
                    ms = eager = _cpu_median_ms(step, repeat=a.repeats)
                for x in qkv:
                    x.grad = None
                layout[name] = {"ms": ms, "eager_ms": eager, "kernels_fwd": counts["fwd"][0],
                                "passes_fwd": counts["fwd"][1], "kernels_bwd": counts["bwd"][0],
                                "passes_bwd": counts["bwd"][1]}
                print(f"cp {cp}  layout {name:<9} {'device' if gpu else 'cpu'} time {ms:7.3f} ms"
                      f" (eager {eager:7.3f}) | kernels fwd {counts['fwd'][0]:3d} bwd "
                      f"{counts['bwd'][0]:3d} | passes per tensor fwd {counts['fwd'][1]:5.2f} "
                      f"bwd {counts['bwd'][1]:5.2f}", flush=True)
            del qkv, paths
        base = {"cp": cp, "seq": a.seq, "heads_after_split": a.heads // cp, "kv_heads": kv,
                "head_dim": a.head_dim, "device": a.device,
                "layout_ms": round(layout["packed"]["ms"], 3),
                "layout_eager_ms": round(layout["packed"]["eager_ms"], 3),
                "layout_reference_ms": round(layout["reference"]["ms"], 3),
                "layout_reference_eager_ms": round(layout["reference"]["eager_ms"], 3),
                "layout": layout}
        if sp_variants:
            sp_rows += _state_passing_rows(a, cp, kv, sp_variants, layout, dev, dt, gpu)
        if not gpu or not a.variants:
            rows.append(base)
            continue
        for variant in a.variants:
            fn, inputs = _op(variant, a.heads // cp, a.head_dim, a.seq, dev)

            def op(fn=fn):
                out = fn()
                out.backward(torch.ones_like(out))

            op_ms, op_eager = (median_ms(op, repeat=a.repeats, queue_full=True),
                               median_ms(op, repeat=a.repeats))
            rows.append({**base, "variant": variant, "op_ms": round(op_ms, 3),
                         "op_eager_ms": round(op_eager, 3),
                         "layout_fraction": round(base["layout_ms"] / op_ms, 4),
                         "layout_reference_fraction": round(base["layout_reference_ms"] / op_ms,
                                                            4)})
            print(f"cp {cp}  {variant:<12} device time: op fwd+bwd {op_ms:8.2f} ms, layout "
                  f"{base['layout_ms']:6.2f} ms = {100 * base['layout_ms'] / op_ms:5.1f}% "
                  f"(reference {base['layout_reference_ms']:6.2f} ms = "
                  f"{100 * base['layout_reference_ms'] / op_ms:5.1f}%) | eager: op "
                  f"{op_eager:8.2f} ms", flush=True)
            del inputs
            torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
            "args": vars(a), "rows": rows}
    if sp_variants:
        info["state_passing_rows"] = sp_rows
    print(json.dumps(info, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)
    print("\n| N | layout packed (was) | passes/tensor fwd, bwd (was) | kernels fwd, bwd (was) |"
          + (" op | layout / op (was) |" if gpu and a.variants else ""))
    print("| --- | --- | --- | --- |" + (" --- | --- |" if gpu and a.variants else ""))
    for r in rows:
        lp, lr = r["layout"]["packed"], r["layout"]["reference"]
        line = (f"| {r['cp']} | {r['layout_ms']:.3g} ms ({r['layout_reference_ms']:.3g} ms) | "
                f"{lp['passes_fwd']}, {lp['passes_bwd']} ({lr['passes_fwd']}, "
                f"{lr['passes_bwd']}) | {lp['kernels_fwd']}, {lp['kernels_bwd']} "
                f"({lr['kernels_fwd']}, {lr['kernels_bwd']}) |")
        if "variant" in r:
            line += (f" {r['variant']} {r['op_ms']:.3g} ms | {100 * r['layout_fraction']:.1f}% "
                     f"({100 * r['layout_reference_fraction']:.1f}%) |")
        print(line)
    if sp_variants:
        print("\n| N | variant | state passing (heads whole) | all-to-all: layout + op on h/N "
              "| state passing / all-to-all |")
        print("| --- | --- | --- | --- | --- |")
        for r in sp_rows:
            print(f"| {r['cp']} | {r['variant']} | {r['state_passing_ms']:.3g} ms | "
                  f"{r['all_to_all_ms']:.3g} ms ({r['layout_ms']:.3g} + "
                  f"{r['all_to_all_op_ms']:.3g}) | {r['ratio']:.2f} |")
    if sp_variants and ours:
        from megatron_subq.initialize import destroy_single_process

        destroy_single_process()
    return 0


if __name__ == "__main__":
    sys.exit(main())
