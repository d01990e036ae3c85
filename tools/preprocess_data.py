"""jsonl (one ``{"text": ...}`` per line) -> megatron indexed dataset(s) and a blend file.

    # one file (.jsonl, .jsonl.gz, .jsonl.xz or .jsonl.zst): its lines are tokenized in parallel
    python tools/preprocess_data.py --input ../shared/data/docs-corpus.jsonl.xz \
        --output-prefix data/docs --tokenizer-type GPTSentencePieceTokenizer \
        --tokenizer-model mistral --workers 4
    # -> data/docs_text_document.bin / .idx and data/docs_text.blend

    # many shards (a folder, searched recursively, or a quoted glob): one shard per worker task,
    # resumable; merged at the end into --merge-into K datasets
    python tools/preprocess_data.py --input 'SlimPajama-627B/train/chunk*/*.jsonl.zst' \
        --output-prefix data/slimpajama --tokenizer-type GPTSentencePieceTokenizer \
        --tokenizer-model mistral --workers 32 --merge-into 4
    # -> data/slimpajama_{00..03}_text_document.bin/.idx, data/slimpajama_text.blend
    #    (train with --data-args-path data/slimpajama_text.blend)

Flags as Megatron-LM's ``tools/preprocess_data.py`` where it has them. An EOD token is appended to
every document (``--no-append-eod`` to skip); the token dtype is the smallest that fits the
vocabulary; ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` writes the
``.bin``/``.idx`` pairs (and ``add_index`` merges the shards' pairs).

Lines: a blank line is skipped (and counted); a document with empty text is skipped (counted: its
lone EOD would train on nothing). A line that is not JSON, not an object, lacks a ``--json-keys``
key or holds a non-string under it is an error naming the file and line (nothing final is
written); with ``--skip-bad-lines`` such lines are skipped and counted by reason, with the
file:line of the first few, in the summary.

Sharded runs (``--input`` a folder, a glob or several paths). Shards are taken in natural path
order (``chunk2`` before ``chunk10``), which is the order of the merged documents. The work
folder ``PREFIX_shards/`` holds ``manifest.json`` (the settings that define the tokens) and one
dataset per finished shard, written under temporary names and renamed once complete, with a
``.json`` record written last. Run again with the same command, a killed run skips the finished
shards ("resuming: K of N shards already done") and redoes only the unfinished ones; a command
whose tokens would differ (``--tokenizer-type``, ``--tokenizer-model`` or its file's contents,
``--vocab-size``, ``--json-keys``, ``--append-eod``) is refused naming the flag. Once every shard
is done they are merged into ``--merge-into`` datasets of consecutive shards (about equal token
counts), the blend file ``PREFIX_<key>.blend`` is written, and the per-shard datasets are deleted
(``--keep-shards`` keeps them); the manifest stays, so the same command again reports "already
complete". A lock in the work folder refuses a second concurrent run on the same prefix.

Blend file (read by the trainer's ``--data-args-path``): Megatron-LM's ``--data-path`` value,
whitespace-separated: ``PREFIX`` alone, or ``WEIGHT PREFIX`` pairs (weights = token counts, so
sampling follows the concatenation); ``#`` starts a comment; relative prefixes are relative to
the blend file's folder.

Test hook: ``SUBQ_PREPROCESS_SHARD_DELAY_S`` (seconds, read only by this tool) makes every shard
task sleep that long before it starts, so a test can kill a run between shards.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import signal
import sys
import time
from collections import Counter
from multiprocessing import Pool
from typing import Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz", ".jsonl.zst")
MANIFEST_FORMAT = 1
DELAY_ENV = "SUBQ_PREPROCESS_SHARD_DELAY_S"
EXAMPLES = 5  # file:line examples kept per reason of skipped lines
# settings that define the tokens of a shard: a resumed run must have the same (flag names)
MEANING_FLAGS = {"tokenizer_type": "--tokenizer-type", "tokenizer_model": "--tokenizer-model",
                 "tokenizer_sha256": "--tokenizer-model", "vocab_size": "--vocab-size",
                 "json_keys": "--json-keys", "append_eod": "--append-eod/--no-append-eod",
                 "dtype": "--tokenizer-model"}

_TOKENIZER = None  # one per worker process
_ARGS = None
_REPORT = None  # progress sink: (documents, tokens, bytes) increments


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
def _open_binary(path: str):
    """A binary stream of the decompressed file (.gz, .xz, .zst or plain)."""
    if path.endswith(".zst"):
        import zstandard  # noqa: PLC0415 - only .zst inputs need it

        # multi-frame files (pzstd, concatenations) are read to their end; long-window frames
        # (zstd --long) are accepted
        dctx = zstandard.ZstdDecompressor(max_window_size=2 ** 31)
        raw = open(path, "rb")
        return io.BufferedReader(dctx.stream_reader(raw, read_across_frames=True, closefd=True),
                                 buffer_size=1 << 20)
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def open_text(path: str):
    """Open a .jsonl, .jsonl.gz, .jsonl.xz or .jsonl.zst file as text (undecodable bytes
    replaced)."""
    return io.TextIOWrapper(_open_binary(path), encoding="utf-8", errors="replace")


def numbered_lines(path: str, limit: Optional[int] = None) -> Iterator[Tuple[int, bytes]]:
    """(1-based line number, raw line) of the decompressed file; lines end at ``\\n``."""
    with _open_binary(path) as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and number > limit:
                return
            yield number, line


def encode(item: Tuple[int, bytes]):
    """(line number, raw line) -> (line number, {key: ids} or None, problem, detail, bytes).

    ``problem`` is None, "blank line" (skipped, not an error) or the reason the line is bad."""
    number, raw = item
    nbytes = len(raw)
    line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    if not line.strip():
        return number, None, "blank line", "", nbytes
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return number, None, "invalid JSON", f" ({e.msg} at character {e.pos + 1})", nbytes
    if not isinstance(record, dict):
        return number, None, "not a JSON object", f" (a {type(record).__name__})", nbytes
    out = {}
    for key in _ARGS.json_keys:
        if key not in record:
            return number, None, f"no {key!r} key", f" (keys: {', '.join(list(record)[:8])})", \
                nbytes
        text = record[key]
        if not isinstance(text, str):
            return number, None, f"{key!r} is not a string", f" (a {type(text).__name__})", nbytes
        ids = list(_TOKENIZER.tokenize(text)) if text else []
        if _ARGS.append_eod:
            ids.append(_TOKENIZER.eod)
        out[key] = ids
    return number, out, None, "", nbytes


def _natural_key(path: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def expand_inputs(items: List[str], error) -> Tuple[List[str], bool]:
    """(input files in natural path order, single-file mode?) for the ``--input`` items: files,
    folders (searched recursively for ``SUFFIXES``) and glob patterns. ``error(msg)`` reports a
    bad item."""
    if len(items) == 1 and os.path.isfile(items[0]):
        return [items[0]], True
    found: List[str] = []
    for item in items:
        if os.path.isfile(item):
            found.append(item)
        elif os.path.isdir(item):
            shards = [os.path.join(d, f) for d, _, files in os.walk(item) for f in files
                      if f.endswith(SUFFIXES)]
            if not shards:
                error(f"--input {item}: the folder holds no {'/'.join(SUFFIXES)} file")
            found += shards
        elif glob.has_magic(item):
            matched = [p for p in glob.glob(item, recursive=True) if os.path.isfile(p)]
            shards = [p for p in matched if p.endswith(SUFFIXES)]
            if not shards:
                error(f"--input {item}: the pattern matches no {'/'.join(SUFFIXES)} file"
                      + (f" ({len(matched)} other file(s))" if matched else ""))
            found += shards
        else:
            error(f"--input {item}: no such file, folder or glob pattern")
    return sorted(set(found), key=_natural_key), False


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------
def get_args(argv=None) -> argparse.Namespace:
    from megatron_subq.training.arguments import TOKENIZER_TYPES  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, nargs="+",
                   help="one file (.jsonl, .jsonl.gz, .jsonl.xz, .jsonl.zst), or shards: folders "
                        "(searched recursively), quoted glob patterns ('dir/**/*.jsonl.zst') or "
                        "several files")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract; one dataset per key")
    g.add_argument("--max-documents", type=int, default=None,
                   help="read only the first N lines of a single-file --input (e.g. for tests)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) lines that are not a JSON object with a string under "
                        "every --json-keys key, instead of stopping with an error at the first")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model, tokenizer.json, or 'mistral' (mistral-common's)")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="append the EOD token to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_<key>_document.bin/.idx (PREFIX_NN_<key>_document with "
                        "--merge-into > 1) and the blend file PREFIX_<key>.blend")
    g.add_argument("--merge-into", type=int, default=1,
                   help="sharded input: merge the shards into this many datasets of consecutive "
                        "shards (about equal token counts)")
    g.add_argument("--keep-shards", action="store_true",
                   help="sharded input: keep the per-shard datasets in PREFIX_shards/ after the "
                        "merge (otherwise deleted once merged)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="tokenizing processes (sharded input: one shard per task)")
    g.add_argument("--chunk-size", type=int, default=16,
                   help="single-file input: documents per worker task")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar (sharded input: one log line per finished shard)")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    if args.chunk_size < 1:
        p.error(f"--chunk-size={args.chunk_size} must be >= 1")
    if args.max_documents is not None and args.max_documents < 1:
        p.error(f"--max-documents={args.max_documents} must be >= 1")
    if args.merge_into < 1:
        p.error(f"--merge-into={args.merge_into} must be >= 1")
    args.json_keys = list(dict.fromkeys(args.json_keys))
    args.files, args.single = expand_inputs(args.input, p.error)
    if not args.single:
        if args.max_documents is not None:
            p.error(f"--max-documents takes a slice of a single-file --input; this --input is "
                    f"{len(args.files)} shard(s)")
        if args.merge_into > len(args.files):
            p.error(f"--merge-into={args.merge_into} exceeds the {len(args.files)} input "
                    f"shard(s)")
    elif args.merge_into > 1:
        p.error(f"--merge-into={args.merge_into} needs a sharded --input (a folder, a glob or "
                f"several files); {args.files[0]} is one file")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        p.error("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type != "NullTokenizer" and args.tokenizer_model is None:
        p.error(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    try:  # fail here, not in every worker
        from megatron_subq.training.tokenizer import (  # noqa: PLC0415
            build_tokenizer,
            resolve_tokenizer_model,
        )

        args._vocab_size = build_tokenizer(args.tokenizer_type, args.tokenizer_model,
                                           args.vocab_size).vocab_size
        args._tokenizer_path = (resolve_tokenizer_model(args.tokenizer_model)
                                if args.tokenizer_model is not None else None)
    except ValueError as e:
        p.error(str(e))
    return args


def _init_worker(args, queue=None, child: bool = False) -> None:
    global _TOKENIZER, _ARGS, _REPORT
    from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415

    if child:  # a pool worker: dies with the parent (a killed run leaves no writer behind)
        from megatron_subq.training.processes import die_with_parent  # noqa: PLC0415

        die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    if queue is not None:
        _REPORT = queue.put
    _ARGS = args
    _TOKENIZER = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)


# ------------------------------------------------------------------------------------------------
# statistics and summary
# ------------------------------------------------------------------------------------------------
def _new_stats(keys) -> dict:
    return {"documents": 0, "empty": 0, "blank": 0, "bytes": 0,
            "tokens": {k: 0 for k in keys}, "malformed": {}, "examples": {}}


def _add_stats(total: dict, part: dict) -> None:
    for name in ("documents", "empty", "blank", "bytes"):
        total[name] += part[name]
    for key, n in part["tokens"].items():
        total["tokens"][key] = total["tokens"].get(key, 0) + n
    for reason, n in part["malformed"].items():
        total["malformed"][reason] = total["malformed"].get(reason, 0) + n
        room = EXAMPLES - len(total["examples"].setdefault(reason, []))
        total["examples"][reason] += part["examples"].get(reason, [])[:max(room, 0)]


def _take_line(stats: dict, builders: dict, dtype, where: str, encoded, args) -> Optional[str]:
    """One ``encode`` result into ``stats`` and the dataset ``builders`` (single file and shards
    alike): blank lines and empty documents counted, bad lines counted with up to ``EXAMPLES``
    places under ``--skip-bad-lines``, else their error text returned (None when all is well)."""
    _, out, problem, detail, nbytes = encoded
    stats["bytes"] += nbytes
    if problem == "blank line":
        stats["blank"] += 1
        return None
    if problem is not None:
        if not args.skip_bad_lines:
            return _bad_line_error(where, problem, detail)
        stats["malformed"][problem] = stats["malformed"].get(problem, 0) + 1
        examples = stats["examples"].setdefault(problem, [])
        if len(examples) < EXAMPLES:
            examples.append(where)
        return None
    if all(len(ids) <= int(args.append_eod) for ids in out.values()):
        stats["empty"] += 1  # no text: nothing to train on (its lone EOD is not written)
        return None
    import numpy as np  # noqa: PLC0415 - as everywhere in this tool: not at start-up

    for key, ids in out.items():
        builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
        stats["tokens"][key] += len(ids)
    stats["documents"] += 1
    return None


def _bad_line_error(where: str, problem: str, detail: str) -> str:
    return (f"error: {where}: {problem}{detail}. Every line must be a JSON object with a string "
            f"under every --json-keys key ({', '.join(_ARGS.json_keys)}); fix the line, or "
            f"pass --skip-bad-lines to skip (and count) such lines")


def _print_summary(args, stats: dict, outputs: Dict[str, List[str]], blends: Dict[str, str],
                   elapsed: float, work: dict) -> None:
    import numpy as np  # noqa: PLC0415
    from megatron.core.datasets.indexed_dataset import DType  # noqa: PLC0415

    total = sum(stats["tokens"].values())
    dtype = np.dtype(DType.optimal_dtype(args._vocab_size)).name
    print(f"\nwrote {stats['documents']:,} documents, {total:,} tokens "
          f"({'EOD appended' if args.append_eod else 'no EOD'}, {dtype}); this run tokenized "
          f"{work['tokens']:,} tokens in {elapsed:.1f} s "
          f"({work['tokens'] / max(elapsed, 1e-9):,.0f} tokens/s, "
          f"{work['bytes'] / 1e6 / max(elapsed, 1e-9):.1f} MB/s of jsonl)")
    for key, prefixes in outputs.items():
        for prefix in prefixes:
            print(f"  {key}: {prefix}.bin / .idx")
        print(f"  {key}: blend file {blends[key]} ({stats['tokens'][key]:,} tokens)")
    if stats["empty"]:
        print(f"  skipped {stats['empty']:,} empty document(s)")
    if stats["blank"]:
        print(f"  skipped {stats['blank']:,} blank line(s)")
    malformed = sum(stats["malformed"].values())
    if malformed:
        print(f"  skipped {malformed:,} malformed line(s) (--skip-bad-lines):")
        for problem, count in sorted(stats["malformed"].items(), key=lambda kv: -kv[1]):
            shown = ", ".join(stats["examples"][problem][:EXAMPLES])
            more = " ..." if count > EXAMPLES else ""
            print(f"    {count:,} x {problem} ({shown}{more})")
    else:
        print("  no malformed lines")


def _check_not_empty(args, stats: dict, what_input: str) -> None:
    no_tokens = [k for k in args.json_keys if stats["tokens"].get(k, 0) == 0]
    if stats["documents"] and not no_tokens:
        return
    what = ("no documents" if stats["documents"] == 0 else
            f"no tokens under key(s) {', '.join(map(repr, no_tokens))}")
    read = f"the first {args.max_documents:,} lines, " if args.max_documents else ""
    malformed = sum(stats["malformed"].values())
    raise SystemExit(
        f"error: --input {what_input} yielded {what} ({read}{stats['bytes']:,} bytes read: "
        f"{malformed:,} malformed line(s), {stats['blank']:,} blank line(s), "
        f"{stats['empty']:,} empty document(s)); nothing was written (a dataset without tokens "
        f"cannot be trained on). Each line must be a JSON object with a non-empty string under "
        f"every --json-keys key ({', '.join(args.json_keys)})")


def _write_json(path: str, data: dict) -> None:
    """Atomically: a temporary name, then renamed."""
    with open(path + ".partial", "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)


def write_blend(path: str, prefixes: List[str], weights: Optional[List[int]],
                comment: str) -> None:
    """The blend file ``--data-args-path`` reads: ``PREFIX`` or ``WEIGHT PREFIX`` lines, prefixes
    relative to the file's folder, after a ``#`` comment."""
    folder = os.path.dirname(os.path.abspath(path))
    names = [os.path.relpath(os.path.abspath(p), folder) for p in prefixes]
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += names if weights is None else [f"{w} {n}" for w, n in zip(weights, names)]
    with open(path + ".partial", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".partial", path)


def _blend_comment(args, stats_tokens: int, datasets: int) -> str:
    return (f"tools/preprocess_data.py --tokenizer-type {args.tokenizer_type}"
            f"{' --tokenizer-model ' + args.tokenizer_model if args.tokenizer_model else ''}"
            f"{'' if args.append_eod else ' --no-append-eod'}: {datasets} dataset(s), "
            f"{stats_tokens:,} tokens\n"
            "train with --data-args-path THIS_FILE; prefixes are relative to this file's folder"
            + ("; weights are token counts" if datasets > 1 else ""))


def main(argv=None) -> dict:
    """Run the tool; returns the statistics (documents, tokens per key, empty, blank, malformed
    per reason), ``prefixes`` (key -> the first output prefix), ``datasets`` (key -> every output
    prefix) and ``blends`` (key -> blend file). Errors exit (SystemExit with the message)."""
    args = get_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    if args.single:
        return _run_single(args)
    return _run_shards(args)


# ------------------------------------------------------------------------------------------------
# one file: its lines tokenized in parallel
# ------------------------------------------------------------------------------------------------
def _run_single(args) -> dict:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: PLC0415

    dtype = DType.optimal_dtype(args._vocab_size)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    # written under temporary names, renamed only once complete and non-empty: a failed or
    # interrupted run leaves no output (and an earlier run's output untouched)
    partial = {k: (p + ".bin.partial", p + ".idx.partial") for k, p in prefixes.items()}
    builders = {k: IndexedDatasetBuilder(partial[k][0], dtype=dtype) for k in prefixes}
    try:
        return _write_single(args, prefixes, partial, builders, dtype)
    finally:
        for paths in partial.values():
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)


def _write_single(args, prefixes, partial, builders, dtype) -> dict:
    from tqdm import tqdm  # noqa: PLC0415

    path = args.files[0]
    start = time.perf_counter()
    stats = _new_stats(args.json_keys)
    lines = numbered_lines(path, args.max_documents)
    pool = Pool(args.workers, initializer=_init_worker, initargs=(args, None, True)) \
        if args.workers > 1 else None
    _init_worker(args)  # this process too: error messages read _ARGS
    results = pool.imap(encode, lines, args.chunk_size) if pool else map(encode, lines)
    bar = tqdm(results, unit=" docs", disable=args.no_progress, total=args.max_documents,
               desc="tokenizing", mininterval=1.0)
    try:
        for encoded in bar:
            documents = stats["documents"]
            error = _take_line(stats, builders, dtype, f"{path}:{encoded[0]}", encoded, args)
            if error:
                raise SystemExit(error + "; nothing was written")
            if stats["documents"] != documents and stats["documents"] % 100 == 0:
                bar.set_postfix(tokens=sum(stats["tokens"].values()))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(partial[key][1])
    elapsed = time.perf_counter() - start
    _check_not_empty(args, stats, path)
    blends = {}
    for key, prefix in prefixes.items():
        os.replace(partial[key][0], prefix + ".bin")
        os.replace(partial[key][1], prefix + ".idx")
        blends[key] = f"{args.output_prefix}_{key}.blend"
        write_blend(blends[key], [prefix], None, _blend_comment(args, stats["tokens"][key], 1))
    outputs = {k: [p] for k, p in prefixes.items()}
    _print_summary(args, stats, outputs, blends, elapsed,
                   {"tokens": sum(stats["tokens"].values()), "bytes": stats["bytes"]})
    return dict(stats, prefixes=prefixes, datasets=outputs, blends=blends)


# ------------------------------------------------------------------------------------------------
# shards: one per task, resumable, merged at the end
# ------------------------------------------------------------------------------------------------
def shard_id(path: str) -> str:
    """The stable name of a shard's files in the work folder (its base name + a path hash)."""
    base = os.path.basename(path)
    for suffix in SUFFIXES[::-1]:
        if base.endswith(suffix):
            base = base[:-len(suffix)]
            break
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:48]
    return f"{base}-{hashlib.sha1(path.encode()).hexdigest()[:10]}"


def _settings(args) -> dict:
    import numpy as np  # noqa: PLC0415
    from megatron.core.datasets.indexed_dataset import DType  # noqa: PLC0415

    sha = None
    path = args._tokenizer_path
    if path is not None:
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                sha = hashlib.sha256(f.read()).hexdigest()
    return {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
            "tokenizer_sha256": sha, "vocab_size": args._vocab_size,
            "json_keys": list(args.json_keys), "append_eod": bool(args.append_eod),
            "dtype": np.dtype(DType.optimal_dtype(args._vocab_size)).name}


def _shard_prefix(work: str, sid: str, key: str) -> str:
    return os.path.join(work, f"{sid}_{key}_document")


def _shard_done(work: str, sid: str, path: str, keys) -> Optional[dict]:
    """The record of a finished shard, or None when it must be (re)done: no record, a record of
    another file or size, or data files not of the recorded sizes."""
    record_path = os.path.join(work, sid + ".json")
    if not os.path.isfile(record_path):
        return None
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if record.get("path") != path or record.get("input_bytes") != os.path.getsize(path):
        return None
    for key in keys:
        prefix = _shard_prefix(work, sid, key)
        sizes = record.get("files", {}).get(key)
        if sizes is None or any(not os.path.isfile(prefix + ext) or
                                os.path.getsize(prefix + ext) != size
                                for ext, size in zip((".bin", ".idx"), sizes)):
            return None
    return record


def _do_shard(task) -> dict:
    """Tokenize one shard into the work folder: ``.partial`` files, renamed when complete, its
    ``.json`` record last. Returns the record, or {"error": message} (partial files removed)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: PLC0415

    work, sid, path = task
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)
    keys = _ARGS.json_keys
    dtype = DType.optimal_dtype(_ARGS._vocab_size)
    prefixes = {k: _shard_prefix(work, sid, k) for k in keys}
    partial = {k: (p + ".bin.partial", p + ".idx.partial") for k, p in prefixes.items()}
    stats = _new_stats(keys)
    last = {"documents": 0, "tokens": 0, "bytes": 0, "time": time.monotonic()}

    def report(final=False):
        now = time.monotonic()
        if _REPORT is None or (not final and now - last["time"] < 0.5):
            return
        tokens = sum(stats["tokens"].values())
        _REPORT((stats["documents"] - last["documents"], tokens - last["tokens"],
                 stats["bytes"] - last["bytes"]))
        last.update(documents=stats["documents"], tokens=tokens, bytes=stats["bytes"], time=now)

    number = 0
    builders = {}
    try:
        builders = {k: IndexedDatasetBuilder(partial[k][0], dtype=dtype) for k in keys}
        for number, raw in numbered_lines(path):
            error = _take_line(stats, builders, dtype, f"{path}:{number}",
                               encode((number, raw)), _ARGS)
            if error:
                return {"error": error}
            report()
        for key, builder in builders.items():
            builder.finalize(partial[key][1])
        builders = {}
        files = {}
        for key, prefix in prefixes.items():
            for p in partial[key]:  # on disk before the record says so (a node may crash too)
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(partial[key][0], prefix + ".bin")
            os.replace(partial[key][1], prefix + ".idx")
            files[key] = [os.path.getsize(prefix + ".bin"), os.path.getsize(prefix + ".idx")]
        record = dict(stats, path=path, input_bytes=os.path.getsize(path), files=files)
        _write_json(os.path.join(work, sid + ".json"), record)  # the shard counts as done now
        report(final=True)
        return record
    except Exception as e:  # noqa: BLE001 - a damaged shard (truncated archive, I/O): its message
        return {"error": f"error: {path}: cannot be read after line {number} "
                         f"({type(e).__name__}: {e}); repair or remove the shard"}
    finally:
        for builder in builders.values():
            builder.data_file.close()
        for paths in partial.values():
            for p in paths:
                if os.path.exists(p):
                    os.remove(p)


class _Lock:
    """An exclusive ``flock`` on ``work/lock`` (released when the process dies)."""

    def __init__(self, work: str):
        import fcntl  # noqa: PLC0415

        self.fd = os.open(os.path.join(work, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise SystemExit(f"error: another tools/preprocess_data.py run is writing {work} "
                             "(its lock is held); wait for it or stop it first") from None

    def release(self):
        os.close(self.fd)


def _check_resume(args, work: str, manifest: dict, settings: dict) -> None:
    """Refuse a command whose tokens would differ from the interrupted run's, naming the flag."""
    old = manifest.get("settings", {})

    def shown(name, value):
        if name == "append_eod":
            return "--append-eod" if value else "--no-append-eod"
        return repr(value)

    for name, value in settings.items():
        if old.get(name) != value:
            flag = MEANING_FLAGS[name]
            what = (f"the tokenizer file {args._tokenizer_path} changed since (its contents "
                    "differ)" if name == "tokenizer_sha256" else
                    f"this run has {shown(name, value)}, the earlier run had "
                    f"{shown(name, old.get(name))}")
            if manifest.get("merged"):
                raise SystemExit(
                    f"error: {flag}: {what}; {work} records a finished run with the earlier "
                    f"settings, whose outputs this run would replace. Delete {work} to redo it "
                    "with this run's settings")
            raise SystemExit(
                f"error: {flag}: {what}; {work} holds shards tokenized with the earlier "
                f"settings, which cannot be mixed with this run's. Run the earlier command again "
                f"to resume it, or delete {work} to start over")


def _partition(tokens: List[int], parts: int) -> List[Tuple[int, int]]:
    """``parts`` consecutive non-empty ranges of the shards with about equal token sums."""
    total = sum(tokens)
    bounds = [0]
    cumulative = 0
    for i, n in enumerate(tokens):
        cumulative += n
        while len(bounds) < parts and cumulative >= total * len(bounds) / parts and \
                i + 1 > bounds[-1]:
            bounds.append(i + 1)
    n = len(tokens)
    while len(bounds) < parts:  # too few cuts (e.g. all tokens at the end): cut the tail
        bounds.append(bounds[-1] + 1)
    for j in range(parts - 1, 0, -1):  # leave at least one shard to every later range
        bounds[j] = min(bounds[j], n - (parts - j))
        bounds[j - 1] = min(bounds[j - 1], bounds[j] - 1)
    bounds.append(n)
    return [(bounds[j], bounds[j + 1]) for j in range(parts)]


def _output_prefixes(args, key: str) -> List[str]:
    k = args.merge_into
    if k == 1:
        return [f"{args.output_prefix}_{key}_document"]
    width = max(2, len(str(k - 1)))
    return [f"{args.output_prefix}_{j:0{width}d}_{key}_document" for j in range(k)]


def _run_shards(args) -> dict:
    from tqdm import tqdm  # noqa: PLC0415

    work = f"{args.output_prefix}_shards"
    os.makedirs(work, exist_ok=True)
    lock = _Lock(work)
    try:
        manifest_path = os.path.join(work, "manifest.json")
        settings = _settings(args)
        manifest = None
        if os.path.isfile(manifest_path):
            try:
                with open(manifest_path) as f:
                    manifest = json.load(f)
            except (OSError, ValueError) as e:
                raise SystemExit(f"error: {manifest_path} is unreadable ({e}); delete {work} to "
                                 "start over") from None
            _check_resume(args, work, manifest, settings)
        shards = [(shard_id(p), p) for p in map(os.path.abspath, args.files)]
        done_before = manifest.get("merged") if manifest else None
        if done_before and done_before.get("shards") == [p for _, p in shards] and \
                done_before.get("merge_into") == args.merge_into and \
                _outputs_intact(done_before):
            merged = ", ".join(p for ps in done_before["outputs"].values() for p in ps)
            print(f"already complete: {work}/manifest.json records these {len(shards)} shards "
                  f"merged into {merged}; nothing to do (delete {work} to redo it)")
            return done_before["result"]
        if manifest is None or manifest.get("merged"):
            manifest = {"format": MANIFEST_FORMAT, "settings": settings, "merged": None}
            _write_json(manifest_path, manifest)

        # remove what a killed run left half-written
        leftovers = [f for f in os.listdir(work) if f.endswith(".partial")]
        for f in leftovers:
            os.remove(os.path.join(work, f))
        records = {}
        for sid, path in shards:
            record = _shard_done(work, sid, path, args.json_keys)
            if record is not None:
                if args.skip_bad_lines is False and record["malformed"]:
                    raise SystemExit(
                        f"error: --skip-bad-lines: the earlier run skipped "
                        f"{sum(record['malformed'].values())} bad line(s) of {path} (it ran with "
                        f"--skip-bad-lines); pass --skip-bad-lines again to resume it, or delete "
                        f"{work} to start over")
                records[sid] = record
        todo = [(work, sid, path) for sid, path in shards if sid not in records]
        redo = [path for sid, path in shards if sid not in records and
                any(f.startswith((sid + "_", sid + ".")) for f in leftovers)]
        if records:
            names = [path for sid, path in shards if sid in records]
            shown = ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10
                                             else "")
            print(f"resuming: {len(records)} of {len(shards)} shards already done (skipped: "
                  f"{shown}); {len(todo)} to do", flush=True)
        if redo:
            print(f"  redoing {len(redo)} unfinished shard(s) (their partial output removed): "
                  f"{', '.join(redo[:10])}{' ...' if len(redo) > 10 else ''}", flush=True)

        start = time.perf_counter()
        live = {"documents": 0, "tokens": 0, "bytes": 0}
        bar = tqdm(total=len(shards), initial=len(records), unit="shard", desc="shards",
                   disable=args.no_progress, mininterval=1.0, smoothing=0.1)

        def progress(increment):
            live["documents"] += increment[0]
            live["tokens"] += increment[1]
            live["bytes"] += increment[2]

        def postfix():
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"docs={live['documents']:,} tokens={live['tokens']:,} "
                                f"{live['tokens'] / elapsed:,.0f} tok/s "
                                f"{live['bytes'] / 1e6 / elapsed:.1f} MB/s", refresh=False)

        ran = {"tokens": 0, "bytes": 0}  # this run's shards, for the summary's throughput

        def finished(record):
            if "error" in record:
                raise SystemExit(record["error"] + f". The {len(records)} finished shard(s) are "
                                 f"kept in {work}: the same command resumes after the fix; "
                                 "nothing final was written")
            records[shard_id(record["path"])] = record
            ran["tokens"] += sum(record["tokens"].values())
            ran["bytes"] += record["bytes"]
            bar.update(1)
            postfix()
            if args.no_progress:
                print(f"shard {len(records)}/{len(shards)} done: {record['path']} "
                      f"({record['documents']:,} documents, "
                      f"{sum(record['tokens'].values()):,} tokens)", flush=True)

        try:
            _tokenize_shards(args, todo, progress, postfix, finished)
        except KeyboardInterrupt:
            print(f"\ninterrupted: {len(records)} of {len(shards)} shards done, kept in {work}; "
                  "the same command resumes", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        finally:
            bar.close()
            for f in os.listdir(work):  # a failed or interrupted task's files
                if f.endswith(".partial") and f != "manifest.json.partial":
                    os.remove(os.path.join(work, f))
        elapsed = time.perf_counter() - start
        return _merge(args, work, manifest_path, manifest, shards, records, elapsed, ran)
    finally:
        lock.release()


def _tokenize_shards(args, todo, progress, postfix, finished) -> None:
    if not todo:
        return
    workers = min(args.workers, len(todo))
    if workers == 1:
        global _REPORT
        _init_worker(args)
        _REPORT = lambda inc: (progress(inc), postfix())  # noqa: E731
        try:
            for task in todo:
                finished(_do_shard(task))
        finally:
            _REPORT = None
        return
    import multiprocessing  # noqa: PLC0415
    import queue as queue_module  # noqa: PLC0415

    _init_worker(args)  # error messages built here read _ARGS
    queue = multiprocessing.Queue()
    pool = Pool(workers, initializer=_init_worker, initargs=(args, queue, True))
    try:
        pending = [pool.apply_async(_do_shard, (task,)) for task in todo]
        while pending:
            try:
                progress(queue.get(timeout=0.2))
                while True:
                    progress(queue.get_nowait())
            except queue_module.Empty:
                pass
            postfix()
            still = []
            for result in pending:
                if result.ready():
                    finished(result.get())
                else:
                    still.append(result)
            pending = still
    finally:
        pool.terminate()  # on an error: stop the other tasks now (their .partial files go)
        pool.join()
        queue.close()


def _outputs_intact(merged: dict) -> bool:
    return all(os.path.isfile(prefix + ext) and os.path.getsize(prefix + ext) == size
               for prefix, sizes in merged.get("sizes", {}).items()
               for ext, size in zip((".bin", ".idx"), sizes))


def _merge(args, work, manifest_path, manifest, shards, records, elapsed, ran) -> dict:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: PLC0415

    stats = _new_stats(args.json_keys)
    for sid, _ in shards:
        _add_stats(stats, records[sid])
    what = args.input[0] if len(args.input) == 1 else f"({len(args.input)} items)"
    _check_not_empty(args, stats, f"{what} ({len(shards)} shards)")
    dtype = DType.optimal_dtype(args._vocab_size)
    first = args.json_keys[0]
    ranges = _partition([records[sid]["tokens"][first] for sid, _ in shards], args.merge_into)
    for j, (b, e) in enumerate(ranges):
        if sum(records[sid]["documents"] for sid, _ in shards[b:e]) == 0:
            raise SystemExit(f"error: --merge-into={args.merge_into}: dataset {j} (shards "
                             f"{b}..{e - 1}) would hold no document; give a smaller --merge-into")
    outputs = {k: _output_prefixes(args, k) for k in args.json_keys}
    print(f"merging {len(shards)} shards into {args.merge_into} dataset(s) per key", flush=True)
    written = []
    try:
        for key in args.json_keys:
            for prefix, (b, e) in zip(outputs[key], ranges):
                builder = IndexedDatasetBuilder(prefix + ".bin.partial", dtype=dtype)
                written += [prefix + ".bin.partial", prefix + ".idx.partial"]
                for sid, _ in shards[b:e]:
                    builder.add_index(_shard_prefix(work, sid, key))
                builder.finalize(prefix + ".idx.partial")
        sizes = {}
        for key in args.json_keys:
            for prefix in outputs[key]:
                os.replace(prefix + ".bin.partial", prefix + ".bin")
                os.replace(prefix + ".idx.partial", prefix + ".idx")
                sizes[prefix] = [os.path.getsize(prefix + ".bin"),
                                 os.path.getsize(prefix + ".idx")]
    finally:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
    blends = {}
    for key in args.json_keys:
        weights = None
        if len(ranges) > 1:
            weights = [sum(records[sid]["tokens"][key] for sid, _ in shards[b:e])
                       for b, e in ranges]
        blends[key] = f"{args.output_prefix}_{key}.blend"
        write_blend(blends[key], outputs[key], weights,
                    _blend_comment(args, stats["tokens"][key], len(ranges)))
    result = dict(stats, prefixes={k: v[0] for k, v in outputs.items()}, datasets=outputs,
                  blends=blends, shards=len(shards))
    manifest["merged"] = {"shards": [p for _, p in shards], "merge_into": args.merge_into,
                          "outputs": outputs, "sizes": sizes, "result": result}
    _write_json(manifest_path, manifest)
    if not args.keep_shards:
        for sid, _ in shards:
            for key in args.json_keys:
                for ext in (".bin", ".idx"):
                    path = _shard_prefix(work, sid, key) + ext
                    if os.path.exists(path):
                        os.remove(path)
            os.remove(os.path.join(work, sid + ".json"))
    _print_summary(args, stats, outputs, blends, elapsed, ran)
    return result


if __name__ == "__main__":
    main()
