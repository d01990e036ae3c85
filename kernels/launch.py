"""Kernel launches without Triton's per-call binding: ``fast(kernel)[grid](**kwargs)``.

``JITFunction.run`` binds every argument, specialises each (dtype, 16-byte alignment, integer
value classes), hashes the result and looks the compiled kernel up on every launch: with ~45
arguments, ~85 µs per launch under cProfile (H200, Triton 3.6), and ``fast`` saved ~27 µs per
launch in ASA's eager forward at 2K (0.289 -> 0.207 ms, 3 launches; docs/benchmarks.md "ASA at
head dim 512"). ``fast`` keeps the kernel Triton returned for a launch under a key that is
at least as fine as Triton's own specialisation (tensors: dtype, device, data pointer mod 16;
integers and bools: their exact values; floats: their type; constexprs and launch options: their
values; the current device) and relaunches it through ``CompiledKernel.run`` when the key
recurs, as Triton's own ``run`` does at its end (Triton >= 3.3: every parameter in signature
order, the runtime launch hooks). A key it has not seen goes through ``kernel[grid]`` (which
compiles or finds the kernel) and is remembered (at most ``MAX_KEYS`` per kernel).

Always the plain ``kernel[grid]`` path: a grid given as a callable, positional arguments, a
kernel object that is not a compiled Triton kernel (the interpreter, ``TRITON_INTERPRET=1``,
returns none), Triton before 3.3, or ``MEGATRON_SUBQ_FAST_LAUNCH=0`` (read per launch: an A/B
knob). Default on.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Dict, Optional

import torch

ENV = "MEGATRON_SUBQ_FAST_LAUNCH"
MAX_KEYS = 256  # compiled kernels remembered per kernel (shapes x dtypes x configs)
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@functools.lru_cache(maxsize=None)
def _knobs():
    """Triton's runtime knobs (>= 3.3: where the launch hooks live; the hooks are read from it
    at each launch), or None before that. Looked up once: every launch asks."""
    try:
        from triton import knobs  # noqa: PLC0415
        return knobs.runtime
    except (ImportError, AttributeError):
        return None


def _current_stream(device: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


_UNCACHEABLE = object()


def _arg_key(x):
    """The part of the cache key for one argument (see the module docstring); ``_UNCACHEABLE``
    for an argument of no hashable value."""
    c = x.__class__
    if c is int or c is str or x is None:
        return x
    if c is bool:  # not equal to 1 / 0 here: Triton types a bool apart from an int
        return ("bool", x)
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.device, x.data_ptr() % 16)
    if isinstance(x, float):
        return float
    try:  # constexprs of other types (tl.dtype, ...): by value
        hash(x)
        return x
    except TypeError:
        return _UNCACHEABLE


@functools.lru_cache(maxsize=None)
def _cuda() -> bool:
    return torch.cuda.is_available()


class FastLaunch:
    """``fast(kernel)``: ``[grid](**kwargs)`` launches ``kernel`` as ``kernel[grid](**kwargs)``
    does, relaunching the compiled kernel of a key seen before without Triton's binding."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names: Optional[tuple] = None  # the parameters, read on the first fast launch
        self.defaults: dict = {}
        self.compiled: Dict[tuple, object] = {}

    def _signature(self) -> bool:
        """Read the kernel's parameters once; False when it has no Python signature (a test's
        stand-in): then every launch takes the plain path."""
        if self.names is None:
            try:
                params = inspect.signature(getattr(self.kernel, "fn", self.kernel)).parameters
            except (TypeError, ValueError):
                self.names = ()
                return False
            self.names = tuple(params)
            self.defaults = {n: p.default for n, p in params.items()
                             if p.default is not inspect.Parameter.empty}
        return bool(self.names)

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        hooks = _knobs()
        if (args or callable(grid) or hooks is None or os.environ.get(ENV, "1") == "0"
                or os.environ.get("TRITON_INTERPRET") == "1" or not _cuda()
                or not self._signature()):
            return self.kernel[grid](*args, **kwargs)
        try:
            values = [kwargs[n] if n in kwargs else self.defaults[n] for n in self.names]
        except KeyError:  # a parameter neither given nor defaulted: Triton's own error
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, tuple(kwargs.get(o) for o in _OPTIONS), tuple(map(_arg_key, values)))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](**kwargs)
            if (getattr(compiled, "run", None) is not None and hasattr(compiled, "function")
                    and _UNCACHEABLE not in key[2] and len(self.compiled) < MAX_KEYS):
                self.compiled[key] = compiled
            return compiled
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _current_stream(device)
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
        meta = None if enter is None else compiled.launch_metadata(grid, stream, *values)
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, meta,
                     enter, leave, *values)
        return compiled


_WRAPPED: Dict[int, FastLaunch] = {}


def fast(kernel) -> FastLaunch:
    """The ``FastLaunch`` of ``kernel`` (one per kernel object, made on first use)."""
    f: Optional[FastLaunch] = _WRAPPED.get(id(kernel))
    if f is None or f.kernel is not kernel:
        f = _WRAPPED[id(kernel)] = FastLaunch(kernel)
    return f


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` is a constexpr function whose call
    costs ~2 µs of host time in Triton 3.9)."""
    return -(-a // b)
