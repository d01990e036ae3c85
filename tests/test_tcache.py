"""tools/tcache.py on a made-up Triton cache packed as the GPU scripts pack it (a gzipped tar of
.tcache/ split into parts): the list names each entry's kernel with its size; prune keeps and
drops entries by kernel name, writes parts that unpack to exactly the kept files, and refuses
bad input naming the flag."""

import io
import os
import random
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import tcache  # noqa: E402

_BYTES = random.Random(0)  # incompressible contents: the packed cache spans several parts
FILES = {  # path in the cache -> bytes
    ".tcache/h1/asa_fwd_out_kernel.json": b'{"name": "asa_fwd_out_kernel"}',
    ".tcache/h1/asa_fwd_out_kernel.cubin": _BYTES.randbytes(3000),
    ".tcache/h1/__grp__asa_fwd_out_kernel.json": b"{}",
    ".tcache/h2/window_fwd_kernel.json": b'{"name": "window_fwd_kernel"}',
    ".tcache/h2/window_fwd_kernel.cubin": _BYTES.randbytes(5000),
    ".tcache/h3/window_fwd_kernel.json": b'{"name": "window_fwd_kernel"}',
    ".tcache/h3/window_fwd_kernel.cubin": _BYTES.randbytes(700),
    ".tcache/h4/__grp__decode_search_kernel.json": b"{}",  # a folder with the group file only
    ".tcache/h4/decode_search_kernel.ptx": _BYTES.randbytes(100),
}


def _parts(tmp_path, files=FILES, part_bytes=1024):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    paths = []
    for i in range(0, len(data), part_bytes):
        path = tmp_path / f".tcache.tgz.a{chr(ord('a') + i // part_bytes)}"
        path.write_bytes(data[i:i + part_bytes])
        paths.append(str(path))
    assert len(paths) >= 2  # the test reads several parts
    return paths


def _unpacked(parts):
    tar = tcache.read_parts(parts)
    return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_list_names_each_kernel_with_its_entries_and_bytes(tmp_path):
    tar = tcache.read_parts(_parts(tmp_path))
    assert tcache.entry_kernels(tar) == {".tcache/h1": "asa_fwd_out_kernel",
                                         ".tcache/h2": "window_fwd_kernel",
                                         ".tcache/h3": "window_fwd_kernel",
                                         ".tcache/h4": "decode_search_kernel"}
    assert tcache.summary(tar) == [("window_fwd_kernel", 2, 5700 + 2 * 29),
                                   ("asa_fwd_out_kernel", 1, 3000 + 30 + 2),
                                   ("decode_search_kernel", 1, 102)]


@pytest.mark.parametrize("keep,drop,kernels", [
    (None, "^asa_", {"window_fwd_kernel", "decode_search_kernel"}),
    ("window|decode", None, {"window_fwd_kernel", "decode_search_kernel"}),
    ("_kernel$", "search", {"asa_fwd_out_kernel", "window_fwd_kernel"}),
])
def test_prune_keeps_exactly_the_chosen_entries(tmp_path, keep, drop, kernels):
    parts = _parts(tmp_path)
    out = str(tmp_path / "new" / "tcache.tgz.")
    paths = tcache.prune(tcache.read_parts(parts), keep, drop, out, part_bytes=2048)
    assert len(paths) >= 2 and paths == [out + tcache._suffix(i) for i in range(len(paths))]
    assert all(os.path.getsize(p) == 2048 for p in paths[:-1]) and os.path.getsize(paths[-1])
    got = _unpacked(paths)
    folders = {f for f, k in tcache.entry_kernels(tcache.read_parts(parts)).items()
               if k in kernels}
    assert got == {n: d for n, d in FILES.items() if os.path.dirname(n) in folders}
    # a second prune into the same prefix leaves no stale part behind
    again = tcache.prune(tcache.read_parts(parts), "window", None, out, part_bytes=1 << 20)
    assert again == [out + "aa"] and sorted(os.listdir(tmp_path / "new")) == ["tcache.tgz.aa"]


def test_command_line(tmp_path):
    parts = _parts(tmp_path)
    tool = [sys.executable, os.path.join(ROOT, "tools", "tcache.py")]
    run = subprocess.run(tool + ["list", *parts], capture_output=True, text=True)
    assert run.returncode == 0 and "window_fwd_kernel" in run.stdout \
        and "2 entries" in run.stdout and "in all" in run.stdout
    out = str(tmp_path / "p" / "tcache.tgz.")
    run = subprocess.run(tool + ["prune", *parts, "--drop", "^asa_", "--out", out],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "kept 2 of 3 kernels (decode_search_kernel, window_fwd_kernel)" in run.stdout
    for args, message in [(["prune", *parts, "--out", out], "give --keep and/or --drop"),
                          (["prune", *parts, "--drop", "(", "--out", out],
                           "--drop '(' is not a regular expression"),
                          (["prune", *parts, "--keep", "a", "--part-mb", "0", "--out", out],
                           "--part-mb 0 is invalid"),
                          (["list", str(tmp_path / "nope.aa")], "no such part"),
                          (["list", parts[1]], "not one gzipped tar")]:
        run = subprocess.run(tool + args, capture_output=True, text=True)
        assert run.returncode != 0 and message in run.stderr, (args, run.stderr)
