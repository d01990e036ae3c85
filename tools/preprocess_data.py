"""jsonl (one ``{"text": ...}`` per line; ``.gz`` / ``.xz`` accepted) -> megatron indexed dataset.

    python tools/preprocess_data.py --input ../shared/data/docs-corpus.jsonl.xz \
        --output-prefix data/docs --tokenizer-type GPTSentencePieceTokenizer \
        --tokenizer-model mistral --workers 4
    # -> data/docs_text_document.bin / .idx   (train with --data-path data/docs_text_document)

Flags as Megatron-LM's ``tools/preprocess_data.py``. Documents are tokenized by ``--workers``
processes (order kept), an EOD token is appended to each (``--no-append-eod`` to skip), and
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` writes the ``.bin``/``.idx``
pair, with the smallest token dtype that fits the vocabulary. Lines that are not a JSON object
with a string under every ``--json-keys`` key are counted by reason and reported (with their
line numbers) in the summary, never dropped silently; empty documents are counted too.
Outputs are written as ``.bin.partial``/``.idx.partial`` and renamed once complete; an input that
yields no document (or a key with no token) exits with an error naming it and writes nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import sys
import time
from collections import Counter
from multiprocessing import Pool
from typing import Iterator, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_TOKENIZER = None  # one per worker process
_ARGS = None


def open_text(path: str):
    """Open a .jsonl, .jsonl.gz or .jsonl.xz file as text."""
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", errors="replace")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _init_worker(args) -> None:
    global _TOKENIZER, _ARGS
    from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415

    _ARGS = args
    _TOKENIZER = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


def encode(item: Tuple[int, str]):
    """(line number, line) -> (line number, {key: ids} or None, problem or None, bytes)."""
    number, line = item
    if not line.strip():
        return number, None, "blank line", len(line)
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return number, None, "invalid JSON", len(line)
    if not isinstance(record, dict):
        return number, None, "not a JSON object", len(line)
    out = {}
    for key in _ARGS.json_keys:
        if key not in record:
            return number, None, f"no {key!r} key", len(line)
        text = record[key]
        if not isinstance(text, str):
            return number, None, f"{key!r} is not a string", len(line)
        ids = list(_TOKENIZER.tokenize(text)) if text else []
        if _ARGS.append_eod:
            ids.append(_TOKENIZER.eod)
        out[key] = ids
    return number, out, None, len(line)


def numbered_lines(path: str, limit: Optional[int]) -> Iterator[Tuple[int, str]]:
    with open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and number > limit:
                return
            yield number, line


def get_args(argv=None) -> argparse.Namespace:
    from megatron_subq.training.arguments import TOKENIZER_TYPES  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help=".jsonl, .jsonl.gz or .jsonl.xz")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract; one dataset per key")
    g.add_argument("--max-documents", type=int, default=None,
                   help="read only the first N lines (a slice, e.g. for tests)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model, tokenizer.json, or 'mistral' (mistral-common's)")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the EOD token to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_<key>_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    g.add_argument("--chunk-size", type=int, default=16, help="documents per worker task")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input}: no such file")
    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    if args.max_documents is not None and args.max_documents < 1:
        p.error(f"--max-documents={args.max_documents} must be >= 1")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        p.error("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type != "NullTokenizer" and args.tokenizer_model is None:
        p.error(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    try:  # fail here, not in every worker
        from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415

        args._vocab_size = build_tokenizer(args.tokenizer_type, args.tokenizer_model,
                                           args.vocab_size).vocab_size
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> dict:
    args = get_args(argv)
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: PLC0415

    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    dtype = DType.optimal_dtype(args._vocab_size)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    # written under temporary names, renamed only once complete and non-empty: a failed or
    # interrupted run leaves no output (and an earlier run's output untouched)
    partial = {k: (p + ".bin.partial", p + ".idx.partial") for k, p in prefixes.items()}
    builders = {k: IndexedDatasetBuilder(partial[k][0], dtype=dtype) for k in prefixes}
    try:
        return _write(args, prefixes, partial, builders, dtype)
    finally:
        for paths in partial.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)


def _write(args, prefixes, partial, builders, dtype) -> dict:
    import numpy as np  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    start = time.perf_counter()
    documents = 0
    empty = 0
    tokens = Counter()
    problems: Counter = Counter()
    examples: dict = {}
    read_bytes = 0
    lines = numbered_lines(args.input, args.max_documents)
    pool = Pool(args.workers, initializer=_init_worker, initargs=(args,)) if args.workers > 1 \
        else None
    if pool is None:
        _init_worker(args)
    results = pool.imap(encode, lines, args.chunk_size) if pool else map(encode, lines)
    bar = tqdm(results, unit=" docs", disable=args.no_progress, total=args.max_documents,
               desc="tokenizing", mininterval=1.0)
    try:
        for number, out, problem, nbytes in bar:
            read_bytes += nbytes
            if problem is not None:
                problems[problem] += 1
                examples.setdefault(problem, []).append(number)
                continue
            if all(len(ids) <= int(args.append_eod) for ids in out.values()):
                empty += 1  # no text: nothing to train on (its lone EOD is not written)
                continue
            for key, ids in out.items():
                builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                tokens[key] += len(ids)
            documents += 1
            if documents % 100 == 0:
                bar.set_postfix(tokens=sum(tokens.values()))
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(partial[key][1])
    elapsed = time.perf_counter() - start

    total_tokens = sum(tokens.values())
    malformed = sum(problems.values())
    print(f"\nwrote {documents:,} documents, {total_tokens:,} tokens "
          f"({'EOD appended' if args.append_eod else 'no EOD'}, {np.dtype(dtype).name}) in "
          f"{elapsed:.1f} s ({total_tokens / max(elapsed, 1e-9):,.0f} tokens/s, "
          f"{read_bytes / 2**20 / max(elapsed, 1e-9):.1f} MiB/s)")
    for key, prefix in prefixes.items():
        print(f"  {key}: {prefix}.bin / .idx  ({tokens[key]:,} tokens)")
    if empty:
        print(f"  skipped {empty:,} empty document(s)")
    if malformed:
        print(f"  skipped {malformed:,} malformed line(s):")
        for problem, count in problems.most_common():
            shown = ", ".join(str(n) for n in examples[problem][:5])
            more = " ..." if count > 5 else ""
            print(f"    {count:,} x {problem} (line {shown}{more})")
    else:
        print("  no malformed lines")
    no_tokens = [k for k in prefixes if tokens[k] == 0]
    if documents == 0 or no_tokens:
        what = ("no documents" if documents == 0 else
                f"no tokens under key(s) {', '.join(map(repr, no_tokens))}")
        read = f"the first {args.max_documents:,} lines, " if args.max_documents else ""
        raise SystemExit(
            f"error: --input {args.input} yielded {what} ({read}{read_bytes:,} bytes read: "
            f"{malformed:,} malformed line(s), {empty:,} empty document(s)); nothing was written "
            f"(a dataset without tokens cannot be trained on). Each line must be a JSON object "
            f"with a non-empty string under every --json-keys key ({', '.join(args.json_keys)})")
    for key, prefix in prefixes.items():
        os.replace(partial[key][0], prefix + ".bin")
        os.replace(partial[key][1], prefix + ".idx")
    return {"documents": documents, "tokens": dict(tokens), "empty": empty,
            "malformed": dict(problems), "prefixes": prefixes}


if __name__ == "__main__":
    main()
