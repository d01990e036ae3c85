#!/usr/bin/env python
"""What context parallelism's all-to-all path adds around an op, on one GPU: the layout work.

    python tools/bench_cp_layout.py [--seq 65536] [--heads 16] [--head-dim 128] [--cp 2 4]
        [--variants standard asa superlinear] [--json FILE]

Per CP size, one rank's share: ``sequence_to_heads`` on q, k, v and ``heads_to_sequence`` on
the output (megatron_subq/attention.py: the views, permutes, the zig-zag chunk reorders and
the exchange buffer), forward and backward, against the op it wraps, forward and backward, on
the ``[1, seq, heads/cp, head_dim]`` tensors that rank attends (bf16). The exchange itself is a
local copy here (one GPU: no other rank), so the NCCL transfer is not in the number; the
permutation work is, which is what runs on every GPU whatever the interconnect. CUDA events,
median of --repeats after a warm-up: the device's time (the GPU busy first while the host
enqueues, so launch overhead is hidden) and the eager time (as a step runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from tools.gpu_timing import median_ms  # noqa: E402


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=65536)
    p.add_argument("--heads", type=int, default=16, help="heads per TP rank before the split")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--variants", nargs="+", default=["standard", "asa", "superlinear"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_cp_layout.py needs a CUDA GPU")
    for cp in a.cp:
        if cp < 2 or a.heads % cp or a.seq % (2 * cp):
            raise SystemExit(f"--cp {cp}: needs cp >= 2 dividing --heads {a.heads} and "
                             f"2 x cp dividing --seq {a.seq}")
    from megatron_subq import attention

    dev = torch.device("cuda")
    rows = []
    for cp in a.cp:
        local = a.seq // cp
        qkv = [torch.randn(local, 1, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3)]

        def layout():
            q, k, v = (attention.sequence_to_heads(x, None) for x in qkv)
            out = attention.heads_to_sequence(q + k + v, None)
            out.backward(torch.ones_like(out))

        with mock.patch.object(attention, "get_pg_size", lambda group, cp=cp: cp), \
                mock.patch.object(attention._AllToAll, "apply",
                                  staticmethod(lambda x, group: x.contiguous().clone())):
            layout_ms = median_ms(layout, repeat=a.repeats, queue_full=True)
            layout_eager = median_ms(layout, repeat=a.repeats)
        for variant in a.variants:
            fn, inputs = _op(variant, a.heads // cp, a.head_dim, a.seq, dev)

            def op(fn=fn):
                out = fn()
                out.backward(torch.ones_like(out))

            op_ms, op_eager = (median_ms(op, repeat=a.repeats, queue_full=True),
                                median_ms(op, repeat=a.repeats))
            rows.append({"cp": cp, "variant": variant, "seq": a.seq,
                         "heads_after_split": a.heads // cp, "head_dim": a.head_dim,
                         "layout_ms": round(layout_ms, 3), "op_ms": round(op_ms, 3),
                         "layout_fraction": round(layout_ms / op_ms, 4),
                         "layout_eager_ms": round(layout_eager, 3),
                         "op_eager_ms": round(op_eager, 3)})
            print(f"cp {cp}  {variant:<12} device time: op fwd+bwd {op_ms:8.2f} ms, layout "
                  f"{layout_ms:6.2f} ms = {100 * layout_ms / op_ms:5.1f}% | eager: op "
                  f"{op_eager:8.2f} ms, layout {layout_eager:6.2f} ms", flush=True)
            del inputs
            torch.cuda.empty_cache()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
