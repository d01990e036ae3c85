"""Registers and spills of ASA's gradient kernel (both sides), compiled for sm_90 without a GPU.

Triton compiles for a named target on any machine; its bundled ptxas then reports each kernel's
registers and spill bytes per thread (``ptxas -v``). That is how the launch configurations of
``kernels/asa/function.py`` can be compared for register pressure between GPU sessions. The
local Triton may differ from the device's (3.9 here, 3.6 there): read the numbers as relative.

    python tools/kernel_spills.py                 # BT 128/64, 64/32 rows, BV 128/64, 4/8 warps
    python tools/kernel_spills.py --bt 128 --rows 64 --bv 128 --warps 4   # the GPU default
    python tools/kernel_spills.py --bt 64 --rows 64 --bv 64 --warps 4 --dh 512 --m 128  # d_h 512
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron_subq.kernels.asa import chunk  # noqa: E402

POINTERS = ("q_ptr", "k_ptr", "v_ptr", "pq_ptr", "pk_ptr", "do_ptr", "den_ptr", "r_ptr",
            "states_ptr", "zs_ptr", "dstates_ptr", "dzs_ptr", "dx_ptr", "dv_ptr", "dl_ptr",
            "chunks_ptr")
INTS = ("T", "H", "G", "D", "M", "DV", "NT", "NV", "sqb", "sqt", "sqh", "skb", "skt", "skh",
        "svb", "svt", "svh", "B")


def ptxas() -> str:
    """The bundled ptxas new enough for Triton's PTX (Triton 3.9 ships two)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bin_dir, name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"no ptxas under {bin_dir}")


def _ptxas_report(kernel, consts: dict, dtype: str, warps: int) -> str:
    """'<registers> regs, <bytes> B spilled, <bytes> B shared' of one specialisation."""
    elt = {"bf16": "*bf16", "fp16": "*fp16"}[dtype]
    types = [elt] * 6 + ["*fp32"] * 6 + [elt] * 3 + ["*i32"]
    sig = dict(zip(POINTERS, types))
    sig.update({name: "i32" for name in INTS if name not in consts})
    sig.update({name: "constexpr" for name in consts})
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": 1})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    out = subprocess.run([ptxas(), "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    if not regs:
        return "ptxas failed: " + out.stderr.strip()[-300:]
    return (f"{regs.group(1)} regs, {spill.group(1) if spill else 0} B spilled, "
            f"{compiled.metadata.shared} B shared")


def block_consts(side: int, bt: int, rows: int, bv: int, d: int = 128, bdt: int = 128,
                 m: int = 64) -> dict:
    """The constexprs of one ``asa_bwd_block_kernel`` specialisation; with POINTERS and INTS
    they name every parameter of the kernel (tests/test_asa_kernel.py checks it)."""
    return dict(BT=bt, RB=rows, BD=d, BDT=min(bdt, d), BM=m, BV=bv, NV=-(-d // bv), NORM=0,
                PREC="tf32", SIDE=side, VARLEN=False, DZ=False, TMAJOR=False)


def block_spills(side: int, bt: int, rows: int, bv: int, warps: int, dtype: str,
                 d: int = 128, bdt: int = 128, m: int = 64) -> str:
    """``asa_bwd_block_kernel`` (cfg bwd_rows = rows; d_h = d_v = d in D tiles of bdt, m)."""
    return _ptxas_report(chunk.asa_bwd_block_kernel, block_consts(side, bt, rows, bv, d, bdt, m),
                         dtype, warps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bt", default="128,64", help="comma list of chunk sizes (BT)")
    p.add_argument("--rows", default="64,32", help="comma list of rows per program (bwd_rows)")
    p.add_argument("--bv", default="128,64", help="comma list of Dv blocks (BV_bwd)")
    p.add_argument("--warps", default="4,8", help="comma list of warps per program")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--dh", type=int, default=128, help="d_h = d_v (a power of two)")
    p.add_argument("--bdt", type=int, default=128, help="the D tile (cfg BDT)")
    p.add_argument("--m", type=int, default=64, help="the feature tile (cfg BM)")
    args = p.parse_args(argv)
    for bt in map(int, args.bt.split(",")):
        for rows in (r for r in map(int, args.rows.split(",")) if r <= bt):
            for bv in map(int, args.bv.split(",")):
                for warps in map(int, args.warps.split(",")):
                    for side in (0, 1):
                        name = "query" if side == 0 else "key"
                        report = block_spills(side, bt, rows, bv, warps, args.dtype, args.dh,
                                              args.bdt, args.m)
                        print(f"BT {bt:3d} rows {rows:3d} BV {bv:3d} warps {warps:2d} "
                              f"{name:5s} side: {report}",
                              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
