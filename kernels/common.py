"""Triton helpers shared by the chunked kernels (tile loads, matmul operand casts), the host
check of the kernels' 32-bit offsets, and the launch configs' environment overrides."""

import dataclasses
import functools
import json
import os

import triton
import triton.language as tl

from .checks import check_qkv

INT32_MAX = 2**31 - 1


def check_chunk_kernel_inputs(op: str, q, k, v, dtypes) -> tuple:
    """The checks the nonapprox and approx kernels share, beyond ``checks.check_qkv``: at
    least one token, a dtype they compile for, v's head dim equal to q's. Returns
    ``(B, T, H, H_kv, D)``."""
    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    if T < 1:
        raise ValueError(f"{op}: q, k, v must hold at least one token (T >= 1)")
    if q.dtype not in dtypes:
        raise ValueError(f"{op}: q, k, v have dtype {q.dtype}; the kernel supports "
                         f"{dtypes} (use impl='reference' for others)")
    if v.shape[3] != D:
        raise ValueError(f"{op}: v's head dim ({v.shape[3]}) must equal q's ({D})")
    return B, T, H, H_kv, D


def env_overrides(cfg, env: str):
    """``cfg`` (a frozen launch-config dataclass) with the fields that ``$env`` names (a JSON
    object, for benchmark sweeps) replaced, read on every call; ``cfg`` itself when unset. An
    unknown field is a ValueError naming it and the allowed ones."""
    text = os.environ.get(env)
    if not text:
        return cfg
    overrides = json.loads(text)
    allowed = [f.name for f in dataclasses.fields(cfg)]
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(f"${env}={text}: unknown launch field(s) {unknown}; allowed "
                         f"{allowed}")
    return dataclasses.replace(cfg, **overrides)


def cached_config(env: str):
    """Decorator for a kernel's ``launch_config(...)``: computed once per arguments, per
    interpreter flag (``$TRITON_INTERPRET``) and per text of ``$env`` (its JSON overrides, which
    the function applies with ``env_overrides``), so that sweeps still take effect when the
    variable changes. Why: a config is a frozen dataclass of ~30 fields built and replaced on
    every call, ~75 µs of host time per forward on an H200 host (tools/host_overhead.py,
    2026-11-27), in an op whose GPU time at 2K is ~200 µs. Errors are not cached (raised again)."""
    def wrap(fn):
        @functools.lru_cache(maxsize=1024)
        def cached(interpreting, text, args, kwargs):
            return fn(*args, **dict(kwargs))

        @functools.wraps(fn)
        def launch_config(*args, **kwargs):
            return cached(os.environ.get("TRITON_INTERPRET", "0") == "1", os.environ.get(env),
                          args, tuple(sorted(kwargs.items())))
        return launch_config
    return wrap


def check_int32_offsets(op: str, **sizes: int) -> None:
    """The kernels compute element offsets in 32-bit integers (Triton's type for int arguments
    and ``tl.arange``): refuse, with a message naming the tensor, any tensor of more elements
    than that addresses instead of reading or writing the wrong memory. ``sizes``: name ->
    number of elements (inputs, outputs and the kernel's own buffers)."""
    for name, numel in sizes.items():
        if numel > INT32_MAX:
            raise ValueError(
                f"{op}: {name} has {numel:,} elements, more than the kernels' 32-bit offsets "
                f"address ({INT32_MAX:,}); split the batch or the sequence (chunked prefill), "
                "or use impl='reference'")


@triton.jit
def operand(x, like_ptr, DOT_F32: tl.constexpr):
    """x cast to the matmul operand dtype: the input's (tensor cores), or fp32 where the
    interpreter's bf16 ``tl.dot`` is wrong (``DOT_F32``)."""
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x.to(like_ptr.dtype.element_ty)


@triton.jit
def tile_raw(ptr, t0, T, row_stride, cols, n_cols, BT: tl.constexpr):
    """``[BT, len(cols)]`` rows t0.. of a ``[T, ...]`` slice with row stride ``row_stride``, in the
    stored dtype (zeros outside)."""
    rows = t0 + tl.arange(0, BT)
    mask = (rows[:, None] < T) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def tile(ptr, t0, T, row_stride, cols, n_cols, BT: tl.constexpr):
    """``tile_raw`` in fp32."""
    return tile_raw(ptr, t0, T, row_stride, cols, n_cols, BT).to(tl.float32)
