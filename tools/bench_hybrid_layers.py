"""Time one full-width Nemotron-3-Nano layer group — Mamba-2 (M), MoE (E), attention (*) — forward
+ backward, with each attention variant in the slot, at several sequence lengths (one GPU).

    python tools/bench_hybrid_layers.py --variants standard superlinear --seq 4096 16384 65536 \
        --json bench.json

The group is the Nano preset (``hybrid_preset("nemotron-3-nano-30b-a3b")``: hidden 2688, Mamba-2
64 x 64 heads with state 128, 128 experts top-6 with the shared expert, 32/2 x 128 attention)
cut to the pattern ``ME*``, in bf16, micro-batch 1; the input is the stack's hidden states
(embedding and output layer left out). Per length it reports the group's time and the attention
layer's own share (the same layer timed alone), and each variant's group time relative to
standard's. CUDA events, after warm-up; ``--repeat`` timed runs, the median kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tools.gpu_timing import median_ms  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["standard", "superlinear"])
    p.add_argument("--seq", nargs="+", type=int, default=[4096, 16384, 65536])
    p.add_argument("--pattern", default="ME*", help="the layer group (pattern symbols)")
    p.add_argument("--mamba-impl", default="megatron", choices=("auto", "megatron", "pytorch"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import megatron_subq as subq  # noqa: PLC0415
    from megatron_subq.hybrid import build_hybrid_model, hybrid_preset  # noqa: PLC0415

    subq.init_single_process()
    results = []
    for variant in args.variants:
        torch.manual_seed(0)
        config, kwargs = hybrid_preset(
            "nemotron-3-nano-30b-a3b", num_layers=len(args.pattern),
            hybrid_override_pattern=args.pattern, attention_variant=variant,
            mamba_impl=args.mamba_impl, use_mamba_mem_eff_path=False)
        kwargs.update(vocab_size=1024, max_sequence_length=max(args.seq))
        model = build_hybrid_model(config, **kwargs).cuda()
        stack = model.decoder
        attention = [m for m, s in zip(stack.layers, args.pattern) if s == "*"]
        mixer = type(stack.layers[args.pattern.index("M")].mixer).__name__ \
            if "M" in args.pattern else "-"
        for L in args.seq:
            x = torch.randn(L, 1, config.hidden_size, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True)

            def group():
                out = stack(hidden_states=x, attention_mask=None)
                out.float().square().mean().backward()

            def attention_only():
                out = x
                for layer in attention:
                    out = layer(hidden_states=out, attention_mask=None)[0]
                out.float().square().mean().backward()

            torch.cuda.reset_peak_memory_stats()
            ms = median_ms(group, args.warmup, args.repeat)
            peak = torch.cuda.max_memory_allocated() / 2**30
            ms_attn = median_ms(attention_only, args.warmup, args.repeat) if attention else 0.0
            row = dict(variant=variant, seq=L, group_ms=ms, attention_ms=ms_attn,
                       peak_gib=peak, mixer=mixer, pattern=args.pattern)
            results.append(row)
            print(json.dumps(row), flush=True)
            del x
        del model, stack, attention
        torch.cuda.empty_cache()

    base = {r["seq"]: r["group_ms"] for r in results if r["variant"] == "standard"}
    print(f"\n| variant | tokens | group fwd+bwd (ms) | attention layer (ms) | vs standard | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = base[r["seq"]] / r["group_ms"] if r["seq"] in base else float("nan")
        r["speedup_vs_standard"] = ratio
        print(f"| {r['variant']} | {r['seq']} | {r['group_ms']:.1f} | {r['attention_ms']:.1f} | "
              f"{ratio:.2f}x | {r['peak_gib']:.1f} |")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
