"""Generate text from a trained checkpoint, each attention variant decoding through its own cache.

    python tools/generate.py --load runs/asa --prompt "Once upon a time" --max-new-tokens 64
    python tools/generate.py --load runs/asa --prompt-file prompts.jsonl --max-new-tokens 64 \
        --temperature 0.8 --top-p 0.9 --seed 1 --output completions.jsonl
    torchrun --nproc-per-node 2 tools/generate.py --load runs/asa --prompt "..." \
        --max-new-tokens 64 --tensor-model-parallel-size 2

The model, variant knobs and tokenizer come from the checkpoint (``load_for_inference``; any TP
size, PP = 1). Prompts: every ``--prompt``, then every line of ``--prompt-file`` (jsonl, the
string under ``--json-key``, default ``prompt``). Prints each completion (on the first rank) and,
with ``--output``, writes one JSON line per prompt: ``prompt``, ``completion``, ``tokens`` (the
new token ids). Greedy unless ``--temperature`` > 0; generation stops at the tokenizer's EOD
unless ``--ignore-eos``. ``--decode-cuda-graph``: the superlinear layers' one-token steps through
the captured decode plan (the config's ``superlinear_decode_graph``; the same tokens). See
docs/inference.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint root (holds the tracker file)")
    p.add_argument("--ckpt-step", type=int, default=None, help="step to load (default: latest)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None, help="jsonl file of prompts")
    p.add_argument("--json-key", default="prompt", help="key of the prompt in --prompt-file")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0: no limit (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1: no limit (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible draws)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per forward (default: the whole prompt)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOD token")
    p.add_argument("--decode-cuda-graph", action="store_true",
                   help="superlinear layers' one-token decode steps through a "
                   "SuperlinearDecodePlan captured in a CUDA graph per layer and capacity "
                   "bucket (superlinear_decode_graph; on the CPU the eager step, or the plan "
                   "uncaptured where the checkpoint's subq_impl is 'kernel')")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--output", default=None, help="write JSON lines of the completions here")
    args = p.parse_args(argv)
    if not args.prompt and not args.prompt_file:
        p.error("give at least one --prompt or a --prompt-file")
    if args.batch_size < 1:
        p.error(f"--batch-size={args.batch_size} is invalid: allowed an integer >= 1")
    return args


def read_prompts(args) -> List[str]:
    """``--prompt`` texts, then those of ``--prompt-file``; a ValueError names a bad line."""
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[args.json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"--prompt-file {args.prompt_file} line {number}: no "
                                     f"{args.json_key!r} ({type(e).__name__})") from e
                if not isinstance(text, str):
                    raise ValueError(f"--prompt-file {args.prompt_file} line {number}: "
                                     f"{args.json_key!r} is not a string")
                prompts.append(text)
    return prompts


def main(argv: Optional[List[str]] = None) -> List[dict]:
    """Run the command line; returns the records written to ``--output`` (every rank)."""
    args = parse_args(argv)
    prompts = read_prompts(args)

    import torch.distributed as dist  # noqa: PLC0415

    import megatron_subq  # noqa: F401,PLC0415  (warnings filters, kernels registration)
    from megatron_subq.inference import generate, load_for_inference, unload  # noqa: PLC0415

    overrides = dict(superlinear_decode_graph=True) if args.decode_cuda_graph else {}
    loaded = load_for_inference(args.load, args.ckpt_step, args.tensor_model_parallel_size,
                                sequence_parallel=False, **overrides)
    records = []
    try:
        tok = loaded.tokenizer
        ids = [tok.tokenize(text) for text in prompts]
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt {i} ({prompts[i][:40]!r}) has no tokens")
        eos = None if args.ignore_eos else tok.eod
        for a in range(0, len(ids), args.batch_size):
            new = generate(loaded.model, ids[a:a + args.batch_size], args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, eos_id=eos, prefill_chunk=args.prefill_chunk,
                           vocab_size=tok.vocab_size)
            for text, tokens in zip(prompts[a:a + args.batch_size], new):
                shown = tokens[:-1] if eos is not None and tokens and tokens[-1] == eos else tokens
                records.append({"prompt": text, "completion": tok.detokenize(shown),
                                "tokens": tokens})
    finally:
        first = not dist.is_initialized() or dist.get_rank() == 0
        unload(loaded)
    if first:
        for r in records:
            print(f"{r['prompt']}{r['completion']}")
            print("-" * 20)
        if args.output:
            with open(args.output, "w") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")
    return records


if __name__ == "__main__":
    main()
