"""Triton's compile cache as a device call carries it: list its kernels, keep only some of them.

The GPU scripts (gpu_kernel_suite.sh, gpu_parallel.sh, gpu_nano_evidence.sh) hand Triton's
cache back as `tcache.tgz.aa`, `.ab`, ... (a gzipped tar of `.tcache/` split into 15 MiB
parts), and a later call unpacks `.tcache.tgz.a*` before it compiles anything. A call carries
at most 64 MiB, so a cache grown by kernel sweeps may no longer fit beside the wheels, the data
and a checkpoint (2026-11-27: 34 MB of cache, 95 entries of them one sweep's decode kernel).
This tool works on those parts here, before the call:

    python tools/tcache.py list .tcache.tgz.a*                 # kernels: entries, MB
    python tools/tcache.py prune .tcache.tgz.a* --drop '^(asa|approx|nonapprox|ppa)_' \
        --out /tmp/tc/tcache.tgz.                                # the rest, as new parts
    # then: rm .tcache.tgz.a*; for f in /tmp/tc/tcache.tgz.a*; do cp "$f" ".${f##*/}"; done

An entry is one folder of the cache (one compiled specialisation); its kernel is the name of
its metadata file (`<kernel>.json`, or `__grp__<kernel>.json` in a folder that holds only the
group file). `--keep` and `--drop` are regular expressions searched in that name (`--keep`:
only matches stay; `--drop`: matches go; both may be given). Files outside entry folders stay.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import re
import sys
import tarfile
from collections import defaultdict
from typing import Dict, List, Optional

GROUP = "__grp__"


def read_parts(parts: List[str]) -> tarfile.TarFile:
    """The cache's tar from its parts, in name order (aa, ab, ...), in memory."""
    if not parts:
        raise SystemExit("tcache.py: no parts given (e.g. .tcache.tgz.a*)")
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"tcache.py: no such part: {', '.join(missing)}")
    data = b"".join(pathlib.Path(p).read_bytes() for p in sorted(parts))
    try:
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise SystemExit(f"tcache.py: the parts {sorted(parts)} are not one gzipped tar "
                         f"(a part missing?): {err}") from None


def entry_kernels(tar: tarfile.TarFile) -> Dict[str, str]:
    """Entry folder (its path in the tar) -> kernel name."""
    names: Dict[str, str] = {}
    groups: Dict[str, str] = {}
    for m in tar.getmembers():
        folder, base = os.path.split(m.name)
        if not m.isfile() or not base.endswith(".json"):
            continue
        stem = base[:-len(".json")]
        if stem.startswith(GROUP):
            groups.setdefault(folder, stem[len(GROUP):])
        else:
            names.setdefault(folder, stem)
    return {**groups, **names}


def summary(tar: tarfile.TarFile) -> List[tuple]:
    """(kernel, entries, bytes) sorted by bytes, largest first."""
    kernels = entry_kernels(tar)
    sizes: Dict[str, int] = defaultdict(int)
    entries: Dict[str, set] = defaultdict(set)
    for m in tar.getmembers():
        folder = os.path.dirname(m.name)
        if m.isfile() and folder in kernels:
            sizes[kernels[folder]] += m.size
            entries[kernels[folder]].add(folder)
    return sorted(((k, len(entries[k]), sizes[k]) for k in sizes), key=lambda r: -r[2])


def kept(name: str, keep: Optional[str], drop: Optional[str]) -> bool:
    return (keep is None or re.search(keep, name) is not None) and \
        (drop is None or re.search(drop, name) is None)


def prune(tar: tarfile.TarFile, keep: Optional[str], drop: Optional[str], out_prefix: str,
          part_bytes: int) -> List[str]:
    """Write the kept entries (and every file outside an entry folder) as ``out_prefix`` + aa,
    ab, ... of ``part_bytes`` each; returns the part paths."""
    kernels = entry_kernels(tar)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as new:
        for m in tar.getmembers():
            folder = m.name if m.isdir() else os.path.dirname(m.name)
            if folder in kernels and not kept(kernels[folder], keep, drop):
                continue
            new.addfile(m, tar.extractfile(m) if m.isfile() else None)
    data = buf.getvalue()
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    for old in _parts_at(out_prefix):
        os.unlink(old)
    paths = []
    for i in range(0, max(1, len(data)), part_bytes):
        path = out_prefix + _suffix(i // part_bytes)
        with open(path, "wb") as f:
            f.write(data[i:i + part_bytes])
        paths.append(path)
    return paths


def _suffix(i: int) -> str:
    """split(1)'s part suffixes: aa, ab, ..., az, ba, ..."""
    return chr(ord("a") + i // 26) + chr(ord("a") + i % 26)


def _parts_at(prefix: str) -> List[str]:
    folder, base = os.path.split(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, f) for f in os.listdir(folder)
            if f.startswith(base) and len(f) == len(base) + 2]


def _regex(value: str, flag: str) -> str:
    try:
        re.compile(value)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"{flag} {value!r} is not a regular expression: "
                                         f"{err}") from None
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="kernels of the packed cache: entries and MB")
    ls.add_argument("parts", nargs="+")
    pr = sub.add_parser("prune", help="keep some kernels' entries, write new parts")
    pr.add_argument("parts", nargs="+")
    pr.add_argument("--keep", type=lambda v: _regex(v, "--keep"),
                    help="regex: only kernels whose name matches stay")
    pr.add_argument("--drop", type=lambda v: _regex(v, "--drop"),
                    help="regex: kernels whose name matches go")
    pr.add_argument("--out", required=True, help="prefix of the new parts (… aa, ab, …)")
    pr.add_argument("--part-mb", type=int, default=15, help="MiB per part (default 15)")
    args = p.parse_args(argv)
    tar = read_parts(args.parts)
    if args.cmd == "list":
        rows = summary(tar)
        for name, n, size in rows:
            print(f"{size / 2**20:8.2f} MB {n:4d} entries  {name}")
        print(f"{sum(r[2] for r in rows) / 2**20:8.2f} MB {sum(r[1] for r in rows):4d} entries  "
              f"in all ({sum(os.path.getsize(x) for x in args.parts) / 2**20:.2f} MB packed)")
        return 0
    if args.keep is None and args.drop is None:
        p.error("prune: give --keep and/or --drop")
    if args.part_mb < 1:
        p.error(f"prune: --part-mb {args.part_mb} is invalid: allowed an integer >= 1")
    names = {name for name, _, _ in summary(tar)}
    stay = sorted(n for n in names if kept(n, args.keep, args.drop))
    paths = prune(tar, args.keep, args.drop, args.out, args.part_mb * 2**20)
    size = sum(os.path.getsize(x) for x in paths)
    print(f"kept {len(stay)} of {len(names)} kernels ({', '.join(stay) or 'none'}); "
          f"{len(paths)} part(s), {size / 2**20:.2f} MB: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
