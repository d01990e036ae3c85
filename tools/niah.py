"""Needle in a haystack (RULER's niah, offline): generate samples, evaluate a checkpoint, plot.

    python tools/niah.py generate --tokenizer-type GPTSentencePieceTokenizer \
        --tokenizer-model mistral --lengths 4096,8192 --depths 0,10,...,100 \
        --samples-per-cell 5 --seed 0 --output niah.jsonl [--format train]
    python tools/niah.py eval --load runs/superlinear --lengths 4096,...,65536 \
        --depths 0,10,...,100 --output niah.json --plot niah.png
    python tools/niah.py plot niah.json --output niah.png

Haystacks are sentences of ``--corpus`` (default the docs corpus); the prompt is exactly each
length in tokens. ``eval`` scores a sample as correct iff greedy decoding reproduces the
answer's tokens, computed with one teacher-forced forward pass (docs/evaluation.md). The logic is
``megatron_subq/evaluation/niah.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_subq.evaluation import niah  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, niah.DEFAULT_CORPUS)
TOKENIZER_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer")


def _grid_flags(p: argparse.ArgumentParser, lengths_required: bool) -> None:
    p.add_argument("--lengths", required=lengths_required, default=None,
                   help="prompt lengths in tokens: a comma list, or A,...,C (doubling), e.g. "
                        "4096,...,65536")
    p.add_argument("--depths", default="0,10,...,100",
                   help="needle depths in %% of the haystack: a comma list or A,B,...,C "
                        "(default 0,10,...,100)")
    p.add_argument("--samples-per-cell", type=int, default=None,
                   help="samples per (length, depth) (default: generate 1, eval 5)")
    p.add_argument("--needles", type=int, default=1,
                   help="needles per sample; the first is queried, the others are distractors "
                        "with other keys at random sentence boundaries (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=CORPUS,
                   help="jsonl(.gz/.xz/.zst) of haystack documents (default the docs corpus)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--skip-documents", type=int, default=0,
                   help="start reading the corpus after this many documents (e.g. a held-out "
                        "slice) (default 0)")
    p.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tools/niah.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="write NIAH samples as jsonl")
    _grid_flags(g, lengths_required=True)
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", required=True,
                   help="a SentencePiece .model, 'mistral', or a tokenizer.json (folder)")
    g.add_argument("--output", required=True)
    g.add_argument("--workers", type=int, default=1,
                   help="processes making the samples (the same samples for any number; "
                        "default 1)")
    g.add_argument("--format", default="eval", choices=("eval", "train", "train-answer"),
                   help="eval: full records (prompt, answer, positions, keys); train: "
                        '{"text": prompt + answer} for tools/preprocess_data.py; train-answer: '
                        "the indexed dataset OUTPUT_text_document (prompt + answer + EOD) and "
                        "its loss-mask sidecar OUTPUT_text_document_lossmask (1 on the "
                        "answer's tokens) for the trainer's --subq-loss-mask-data; --output is "
                        "then a prefix (default eval)")

    e = sub.add_parser("eval", help="score a checkpoint, write a JSON result and a heatmap")
    _grid_flags(e, lengths_required=False)
    e.add_argument("--load", required=True, help="checkpoint root (as the trainer's --load)")
    e.add_argument("--ckpt-step", type=int, default=None)
    e.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="default the checkpoint's; an import (tools/convert_checkpoint.py) "
                        "stores none and its tokenizer files are taken (LOAD/hf_files/)")
    e.add_argument("--tokenizer-model", default=None,
                   help="default the checkpoint's (with --tokenizer-type)")
    e.add_argument("--tensor-model-parallel-size", type=int, default=1)
    e.add_argument("--input", default=None,
                   help="score these samples (generate --format eval) instead of generating "
                        "them with the checkpoint's tokenizer")
    e.add_argument("--output", required=True, help="result JSON")
    e.add_argument("--plot", default=None, help="heatmap PNG")
    e.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="samples of equal length are batched up to this many tokens (at least "
                        "one sample per pass) (default 16384)")

    p = sub.add_parser("plot", help="re-plot a result JSON as a heatmap PNG")
    p.add_argument("result")
    p.add_argument("--output", required=True)
    p.add_argument("--size", default="8,6", help="figure inches W,H (default 8,6)")
    p.add_argument("--dpi", type=int, default=100)
    p.add_argument("--title", default=None)
    return parser


def _grid(args, parser, default_samples: int):
    if args.skip_documents < 0:
        parser.error(f"--skip-documents {args.skip_documents}: allowed an integer >= 0")
    try:
        lengths = niah.parse_numbers(args.lengths, "--lengths", doubling=True)
        depths = niah.parse_numbers(args.depths, "--depths")
        samples = args.samples_per_cell if args.samples_per_cell is not None else default_samples
        return niah.check_settings(lengths, depths, samples, args.needles) + (samples,)
    except ValueError as err:
        parser.error(str(err))


def _check_output(parser, flag: str, path: Optional[str]) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: the folder {folder} does not exist")


def cmd_generate(args, parser) -> dict:
    from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415

    lengths, depths, samples = _grid(args, parser, 1)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: allowed an integer >= 1")
    _check_output(parser, "--output", args.output)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        niah.check_lengths(tokenizer, lengths, args.needles)
        pool = niah.load_pool(tokenizer, args.corpus, niah.pool_tokens_for(lengths),
                              args.json_key, args.skip_documents)
    except ValueError as err:
        parser.error(str(err))
    name = f"{args.tokenizer_type}:{args.tokenizer_model}"
    out = niah.generate_samples(tokenizer, lengths, depths, samples, args.needles, args.seed,
                                pool=pool, tokenizer_name=name,
                                progress=not args.no_progress, workers=args.workers)
    if args.format == "train-answer":
        info = niah.write_answer_masked(args.output, out, tokenizer)
        print(f"niah: wrote {info['samples']} samples ({info['tokens']} tokens, "
              f"{info['answer_tokens']} of them answers in the loss mask) to {info['prefix']} "
              f"and {info['mask_prefix']}")
        return {"samples": info["samples"], "output": info["prefix"]}
    if args.format == "train":
        records = [{"text": s.prompt + s.answer} for s in out]
    else:
        records = [s.to_record() for s in out]
    niah.write_jsonl(args.output, records)
    print(f"niah: wrote {len(records)} samples ({args.format}) to {args.output}")
    return {"samples": len(records), "output": args.output}


def cmd_eval(args, parser) -> dict:
    if args.input is None and args.lengths is None:
        parser.error("--lengths is required unless --input gives the samples")
    grid = _grid(args, parser, 5) if args.input is None else None
    _check_output(parser, "--output", args.output)
    _check_output(parser, "--plot", args.plot)
    if args.plot:
        _need_matplotlib(parser, "--plot")
    if args.tensor_model_parallel_size < 1:
        parser.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: allowed "
                     "an integer >= 1 that divides the world size")
    if args.max_batch_tokens < 1:
        parser.error(f"--max-batch-tokens {args.max_batch_tokens}: allowed an integer >= 1")
    try:
        samples_in = niah.read_samples(args.input) if args.input else None
    except ValueError as err:
        parser.error(str(err))

    from megatron_subq.convert.api import checkpoint_namespace  # noqa: PLC0415
    from megatron_subq.inference import load_for_inference, unload  # noqa: PLC0415
    from megatron_subq.training.checkpointing import checkpoint_folder, saved_args  # noqa: PLC0415
    from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415

    # the checkpoint's tokenizer and position limit, checked before the model is built
    folder = checkpoint_folder(args.load, args.ckpt_step)
    if folder is None or not os.path.isdir(folder):
        parser.error(f"--load {args.load}: no checkpoint there (--ckpt-step {args.ckpt_step})")
    try:
        ck, _ = checkpoint_namespace(saved_args(folder), folder)
        tok_type = args.tokenizer_type or ck.tokenizer_type
        tok_model = args.tokenizer_model or (ck.tokenizer_model if not args.tokenizer_type
                                             else None)
        side = os.path.join(args.load, "hf_files")
        if tok_type is None and os.path.isfile(os.path.join(side, "tokenizer.json")):
            # an import keeps the HF folder's tokenizer beside the checkpoint, not in its args
            tok_type, tok_model = "HuggingFaceTokenizer", side
        if tok_type is None:
            raise ValueError(f"--load {args.load}: the checkpoint names no tokenizer; give "
                             "--tokenizer-type and --tokenizer-model")
        tokenizer = build_tokenizer(tok_type, tok_model, ck.vocab_size)
        ck.tokenizer_type, ck.tokenizer_model = tok_type, tok_model
        if ck.tokenizer_type == "NullTokenizer":
            raise ValueError(f"--load {args.load}: the checkpoint was trained with "
                             "NullTokenizer, which has no text; NIAH needs a text tokenizer")
        if grid is not None:
            niah.check_lengths(tokenizer, grid[0], args.needles)
        longest = max(grid[0]) if grid else max(s.prompt_tokens for s in samples_in)
        if ck.position_embedding_type == "learned_absolute" and \
                longest + 16 > ck.max_position_embeddings:
            raise ValueError(f"--lengths {longest}: the checkpoint has learned absolute position "
                             f"embeddings for {ck.max_position_embeddings} positions; allowed "
                             f"lengths <= {ck.max_position_embeddings - 16}")
        if samples_in is None:
            pool = niah.load_pool(tokenizer, args.corpus, niah.pool_tokens_for(grid[0]),
                                  args.json_key, args.skip_documents)
    except ValueError as err:
        parser.error(str(err))
    name = f"{ck.tokenizer_type}:{ck.tokenizer_model}"
    if samples_in is None:
        lengths, depths, per_cell = grid
        samples = niah.generate_samples(tokenizer, lengths, depths, per_cell, args.needles,
                                        args.seed, pool=pool, tokenizer_name=name,
                                        progress=not args.no_progress)
    else:
        samples = samples_in
        other = {s.tokenizer for s in samples if s.tokenizer and s.tokenizer != name}
        if other:
            print(f"niah: warning: --input was generated with {sorted(other)}, the checkpoint's "
                  f"tokenizer is {name}: prompt lengths are re-counted in the checkpoint's")

    loaded = load_for_inference(args.load, args.ckpt_step, args.tensor_model_parallel_size,
                                tokenizer_type=tok_type, tokenizer_model=tok_model)
    try:
        results = niah.evaluate_samples(loaded.model, loaded.tokenizer, samples,
                                        args.max_batch_tokens, progress=not args.no_progress)
        iteration = loaded.iteration
    finally:
        unload(loaded)
    cells = niah.summarize(results)
    result = {
        "checkpoint": os.path.abspath(args.load), "iteration": iteration,
        "attention_variant": getattr(ck, "attention_variant", None),
        "settings": {"lengths": sorted({s.length for s in samples}),
                     "depths": sorted({s.depth for s in samples}),
                     "samples_per_cell": max(c["n"] for c in cells),
                     "needles": len(samples[0].keys) or args.needles,
                     "seed": args.seed if samples_in is None else None,
                     "corpus": args.corpus if samples_in is None else None,
                     "input": args.input, "tokenizer": name,
                     "scoring": "greedy reproduces the answer tokens (teacher-forced argmax)"},
        "accuracy": sum(r["correct"] for r in results) / len(results),
        "mean_answer_logprob": sum(r["answer_logprob"] for r in results) / len(results),
        "cells": cells, "samples": results,
    }
    if _rank() == 0:
        niah.write_json(args.output, result)
        if args.plot:
            niah.write_heatmap(result, args.plot)
        print(f"niah: accuracy {result['accuracy']:.3f} over {len(results)} samples; wrote "
              f"{args.output}" + (f" and {args.plot}" if args.plot else ""))
    return result


def _need_matplotlib(parser, flag: str) -> None:
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("matplotlib") is None:
        parser.error(f"{flag} needs matplotlib (pip install matplotlib, or the package's "
                     "[plots] extra)")


def _rank() -> int:
    try:
        import torch.distributed as dist  # noqa: PLC0415

        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    except ImportError:
        return 0


def cmd_plot(args, parser) -> dict:
    import json  # noqa: PLC0415

    if not os.path.isfile(args.result):
        parser.error(f"result {args.result}: no such file (a JSON written by tools/niah.py eval)")
    _check_output(parser, "--output", args.output)
    try:
        w, h = (float(x) for x in args.size.split(","))
        if w <= 0 or h <= 0:
            raise ValueError
    except ValueError:
        parser.error(f"--size {args.size!r}: allowed W,H in inches, both > 0 (e.g. 8,6)")
    _need_matplotlib(parser, "plot")
    if args.dpi < 10:
        parser.error(f"--dpi {args.dpi}: allowed an integer >= 10")
    with open(args.result, encoding="utf-8") as f:
        result = json.load(f)
    if not result.get("cells"):
        parser.error(f"result {args.result}: no cells (not a tools/niah.py eval result)")
    niah.write_heatmap(result, args.output, (w, h), args.dpi, args.title)
    print(f"niah: wrote {args.output}")
    return {"output": args.output}


def main(argv: Optional[List[str]] = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001
    return {"generate": cmd_generate, "eval": cmd_eval, "plot": cmd_plot}[args.command](args, sub)


if __name__ == "__main__":
    main()
