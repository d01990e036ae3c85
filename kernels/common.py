"""Triton helpers shared by the chunked kernels (tile loads, matmul operand casts), the host
check of the kernels' 32-bit offsets, and ``DirectLauncher`` (Triton launches without the JIT's
per-call dispatch)."""

import os

import torch
import triton
import triton.language as tl

INT32_MAX = 2**31 - 1
LAUNCHER_ENV = "MEGATRON_SUBQ_DIRECT_LAUNCH"  # "0": every launch through Triton's JIT


def _arg_key(arg):
    """What Triton specialises a kernel argument on (Triton 3.x's binder): a tensor's dtype and
    16-byte alignment; an int's equality to 1, divisibility by 16 and 32/64-bit width; the type
    of anything else (floats and bools are not specialised on their value)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):  # before int: bool is an int
        return bool
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31
    return type(arg)


class DirectLauncher:
    """``kernel[grid](*args, **meta)`` with Triton's per-launch dispatch cached.

    Triton's JIT launch binds and specialises every argument and formats a cache key on each
    call: ≈ 35–60 µs for the ASA kernels' ~35 arguments on the H100 machine's host, against ≈ 15
    µs for launching the compiled kernel itself (``tools/host_overhead.py``). A training step
    launches the same few specialisations again and again, so this keeps the compiled kernel of
    each specialisation (its key from ``_arg_key`` of every argument, the constexprs and launch
    options, the device) and launches it directly; the first launch of a key goes through the
    JIT, which compiles and returns it. ``verify`` (tests) checks every direct launch against
    the JIT's own choice. Under the interpreter, or with ``MEGATRON_SUBQ_DIRECT_LAUNCH=0``,
    every launch goes through the JIT."""

    verify = False

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled = {}
        self.__name__ = getattr(kernel, "__name__", repr(kernel))

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def launch(self, grid, args, meta):
        from megatron_subq.ops.dispatch import triton_interpreting  # noqa: PLC0415

        if triton_interpreting() or os.environ.get(LAUNCHER_ENV) == "0":
            self.kernel[grid](*args, **meta)
            return
        key = (torch.cuda.current_device(), tuple(map(_arg_key, args)),
               tuple(meta.items()))
        compiled = self.compiled.get(key)
        if compiled is None:  # first launch of this specialisation: through the JIT
            self.compiled[key] = self.kernel[grid](*args, **meta)
            return
        # the compiled kernel takes every parameter in order, constexprs included
        names = self.kernel.arg_names
        params = args + tuple(meta[name] for name in names[len(args):])
        if self.verify:
            expected = self.kernel.warmup(*args, grid=grid, **meta)
            if expected is not compiled:
                raise AssertionError(f"{self.__name__}: cached launch key {key} picked another "
                                     "specialisation than Triton's JIT")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        compiled[grid](*params)


def check_chunk_kernel_inputs(op: str, q, k, v, dtypes) -> tuple:
    """The checks the nonapprox and approx kernels share, beyond ``ops.dispatch.check_qkv``: at
    least one token, a dtype they compile for, v's head dim equal to q's. Returns
    ``(B, T, H, H_kv, D)``."""
    from megatron_subq.ops.dispatch import check_qkv  # noqa: PLC0415

    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    if T < 1:
        raise ValueError(f"{op}: q, k, v must hold at least one token (T >= 1)")
    if q.dtype not in dtypes:
        raise ValueError(f"{op}: q, k, v have dtype {q.dtype}; the kernel supports "
                         f"{dtypes} (use impl='reference' for others)")
    if v.shape[3] != D:
        raise ValueError(f"{op}: v's head dim ({v.shape[3]}) must equal q's ({D})")
    return B, T, H, H_kv, D


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
