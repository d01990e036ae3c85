"""Exclusive prefix sums over chunks, shared by the chunked linear-attention kernels (ASA's and
approx's state scans; see their chunk.py docstrings).

A chunked scan runs in two parallel steps: each chunk's contribution to the state (a per-chunk
delta kernel of the op, tensor-core products in parallel over all chunks), then these prefix
sums, which carry only a running fp32 sum from one chunk to the next, so their loads stream
ahead of it (a sequential scan's per-chunk matmuls do not). Layout: ``[B*H, NT, L]`` (L values
per chunk), deltas in any float dtype, sums fp32, outputs in a chosen dtype; optional initial
and final sums; with a chunk table (packed sequences, ASA's ``chunk_table``) the sums restart
at every sequence. Launch settings come from the op's config: ``scan_block`` values per
program, ``scan_unroll`` chunks per step, ``scan_warps``, ``scan_stages``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .launch import cdiv, fast


@triton.jit
def _prefix_sums(delta_ptr, out_ptr, init_ptr, final_ptr, chunks_ptr, pid_bh, blk, NT, L,
                 BLOCK: tl.constexpr, UNROLL: tl.constexpr, HAS_INIT: tl.constexpr,
                 STORE_FINAL: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr):
    """Block ``blk`` (BLOCK of the L values) of one (batch, head)'s exclusive prefix sums over
    chunks: the body of both scan kernels below.

    UNROLL chunks are loaded (and stored) as one [UNROLL, BLOCK] tile: the loads do not depend on
    the running sum, so a step waits for one memory round trip instead of UNROLL of them (one
    chunk per step is latency-bound). The sum then runs through the tile's
    rows one at a time, in the same order as a one-chunk loop (bitwise the same results)."""
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    if HAS_INIT:
        run = tl.load(init_ptr + pid_bh * L + offs, mask=mask, other=0.0)
    else:
        run = tl.zeros([BLOCK], dtype=tl.float32)
    steps = tl.arange(0, UNROLL)
    for i0 in range(0, NT, UNROLL):
        live = i0 + steps < NT
        if REVERSE:
            c = NT - 1 - (i0 + steps)
        else:
            c = i0 + steps
        at = (pid_bh * NT + c)[:, None] * L + offs[None, :]
        tile_mask = live[:, None] & mask[None, :]
        # rows past NT: 0; deltas may be stored in half precision (cfg deltas_half), sums fp32
        vals = tl.load(delta_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
        if VARLEN:
            if REVERSE:  # the sequence's last chunk: stop == seq_stop
                restart = (tl.load(chunks_ptr + c * 4 + 1, mask=live, other=0)
                           == tl.load(chunks_ptr + c * 4 + 3, mask=live, other=1))
            else:  # its first chunk: start == seq_start
                restart = (tl.load(chunks_ptr + c * 4, mask=live, other=0)
                           == tl.load(chunks_ptr + c * 4 + 2, mask=live, other=1))
        outs = tl.zeros([UNROLL, BLOCK], dtype=tl.float32)
        for u in tl.static_range(UNROLL):
            row = steps == u
            if VARLEN:
                run = tl.where(tl.sum((row & restart).to(tl.int32), axis=0) > 0, 0.0, run)
            outs = tl.where(row[:, None], run[None, :], outs)
            run += tl.sum(tl.where(row[:, None], vals, 0.0), axis=0)
        tl.store(out_ptr + at, outs, mask=tile_mask)
    if STORE_FINAL:
        tl.store(final_ptr + pid_bh * L + offs, run, mask=mask)


@triton.jit
def chunk_scan_kernel(
    delta_ptr, out_ptr, init_ptr, final_ptr, chunks_ptr, NT, L,
    BLOCK: tl.constexpr, UNROLL: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr,
):
    """grid (cdiv(L, BLOCK), B*H): exclusive prefix sums over chunks, out[c] = init + Σ_{c'<c}
    delta[c'] (REVERSE: Σ_{c'>c}); [B*H, NT, L] fp32. Only a running sum is carried from one
    chunk to the next, so the loads stream ahead of it (unlike the sequential scan's matmuls).
    VARLEN: the sums restart at every sequence's first chunk (last, REVERSE), read from the
    chunk table (start, stop, seq_start, seq_stop per row); there is no init then."""
    _prefix_sums(delta_ptr, out_ptr, init_ptr, final_ptr, chunks_ptr, tl.program_id(1),
                 tl.program_id(0), NT, L, BLOCK, UNROLL, HAS_INIT, STORE_FINAL, REVERSE, VARLEN)


@triton.jit
def chunk_scan_pair_kernel(
    s_delta_ptr, s_out_ptr, s_init_ptr, s_final_ptr,
    z_delta_ptr, z_out_ptr, z_init_ptr, z_final_ptr,
    chunks_ptr, NT, LS, LZ, NBS,
    BLOCK: tl.constexpr, UNROLL: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr,
):
    """grid (NBS + cdiv(LZ, BLOCK), B*H), NBS = cdiv(LS, BLOCK): ``chunk_scan_kernel`` on
    the S deltas ([B*H, NT, LS]) and the z deltas ([B*H, NT, LZ]) in one launch (cfg
    fused_scan): programs below NBS scan S, the others z. The z scan is as long (NT steps) as
    an S block's and as latency-bound, so it rides along instead of costing a launch of its own."""
    pid_l, pid_bh = tl.program_id(0), tl.program_id(1)
    if pid_l < NBS:
        _prefix_sums(s_delta_ptr, s_out_ptr, s_init_ptr, s_final_ptr, chunks_ptr, pid_bh, pid_l,
                     NT, LS, BLOCK, UNROLL, HAS_INIT, STORE_FINAL, REVERSE, VARLEN)
    else:
        _prefix_sums(z_delta_ptr, z_out_ptr, z_init_ptr, z_final_ptr, chunks_ptr, pid_bh,
                     pid_l - NBS, NT, LZ, BLOCK, UNROLL, HAS_INIT, STORE_FINAL, REVERSE, VARLEN)


def scan(delta, init, cfg, reverse: bool, store_final: bool, chunks=None,
          out_dtype=torch.float32):
    """Exclusive prefix sums of ``delta`` [B, H, NT, ...] over chunks (fp32 sums, stored in
    ``out_dtype``); the final sum too (fp32).
    With a chunk table (packed sequences) the sums restart at every sequence."""
    B, H, NT = delta.shape[:3]
    L = math.prod(delta.shape[3:])  # values per chunk (shape arithmetic: no view per call)
    out = torch.empty_like(delta, dtype=out_dtype)
    final = torch.empty((B, H) + tuple(delta.shape[3:]), dtype=torch.float32,
                        device=delta.device) if store_final else out
    _scan_launch(chunk_scan_kernel, B, H, NT, L, cfg.scan_block, cfg.scan_unroll,
                 cfg.scan_warps, cfg.scan_stages, init is not None, store_final, reverse,
                 chunks is not None)(
        delta_ptr=delta, out_ptr=out, init_ptr=init if init is not None else out, final_ptr=final,
        chunks_ptr=chunks if chunks is not None else out)
    return out, (final if store_final else None)


@functools.lru_cache(maxsize=1024)
def _scan_launch(kernel, B, H, NT, L, block, unroll, warps, stages, has_init, store_final,
                 reverse, varlen):
    """``chunk_scan_kernel``'s launch with its non-tensor arguments bound (``launch.Bound``),
    one per shape and config (the kernel is part of the key: tests stand in for it)."""
    return fast(kernel).bind(
        (cdiv(L, block), B * H), NT=NT, L=L, BLOCK=block, UNROLL=unroll, HAS_INIT=has_init,
        STORE_FINAL=store_final, REVERSE=reverse, VARLEN=varlen, num_warps=warps,
        num_stages=stages)


@functools.lru_cache(maxsize=1024)
def _scan_pair_launch(kernel, B, H, NT, LS, LZ, block, unroll, warps, stages, has_init,
                      store_final, reverse, varlen):
    """``chunk_scan_pair_kernel``'s launch with its non-tensor arguments bound."""
    n_s = cdiv(LS, block)
    return fast(kernel).bind(
        (n_s + cdiv(LZ, block), B * H), NT=NT, LS=LS, LZ=LZ, NBS=n_s, BLOCK=block,
        UNROLL=unroll, HAS_INIT=has_init, STORE_FINAL=store_final, REVERSE=reverse,
        VARLEN=varlen, num_warps=warps, num_stages=stages)


def scan_pair(delta, dz, init, z_init, cfg, reverse: bool, store_final: bool, chunks=None,
               out_dtype=torch.float32):
    """``scan`` of the S deltas [B, H, NT, m, Dv] and the z deltas [B, H, NT, m] in one launch
    (cfg fused_scan): (S sums in ``out_dtype``, z sums, (S final, z final) or None)."""
    B, H, NT = delta.shape[:3]
    LS, LZ = math.prod(delta.shape[3:]), math.prod(dz.shape[3:])
    has_init = init is not None
    out, z_out = torch.empty_like(delta, dtype=out_dtype), torch.empty_like(dz)
    final, z_final = out, z_out  # unwritten unless store_final
    if store_final:
        final = torch.empty((B, H) + tuple(delta.shape[3:]), dtype=torch.float32,
                            device=delta.device)
        z_final = torch.empty((B, H) + tuple(dz.shape[3:]), dtype=torch.float32,
                              device=dz.device)
    _scan_pair_launch(chunk_scan_pair_kernel, B, H, NT, LS, LZ, cfg.scan_block,
                      cfg.scan_unroll, cfg.scan_warps, cfg.scan_stages, has_init, store_final,
                      reverse, chunks is not None)(
        s_delta_ptr=delta, s_out_ptr=out, s_init_ptr=init if has_init else out, s_final_ptr=final,
        z_delta_ptr=dz, z_out_ptr=z_out, z_init_ptr=z_init if has_init else z_out,
        z_final_ptr=z_final, chunks_ptr=chunks if chunks is not None else out)
    return out, z_out, ((final, z_final) if store_final else None)
