"""Kernel launches without Triton's per-call binding: ``fast(kernel)[grid](**kwargs)``.

``JITFunction.run`` binds every argument, specialises each (dtype, 16-byte alignment, integer
value classes), hashes the result and looks the compiled kernel up on every launch: with ~45
arguments, ~85 µs per launch under cProfile (H200, Triton 3.6), and ``fast`` saved ~27 µs per
launch in ASA's eager forward at 2K (0.289 -> 0.207 ms, 3 launches; docs/benchmarks.md "ASA at
head dim 512"). ``fast`` keeps the kernel Triton returned for a launch under a key that is
at least as fine as Triton's own specialisation (tensors: dtype, device, data pointer mod 16;
integers, bools, strings and other constexprs: their types and exact values; floats: their
type; the launch options: their values; the current device) and relaunches it through
``CompiledKernel.run`` when the key recurs, as Triton's own ``run`` does at its end (Triton >=
3.3: every parameter in signature order, the runtime launch hooks when any is set). Tensors go
to the launcher as their data pointers (integers): the launcher then neither calls
``data_ptr()`` on each nor asks the driver whether it is a device pointer
(``cuPointerGetAttribute``, once per pointer argument per launch); a tensor Triton refused (a
CPU tensor) never got a key, and the key holds each tensor's device. A key it has not seen goes
through ``kernel[grid]`` (which compiles or finds the kernel) and is remembered (at most
``MAX_KEYS`` per kernel). The per-call-site work (which keyword is which parameter, which are
tensors) is planned once per keyword order and argument types (``_Plan``).

Always the plain ``kernel[grid]`` path: a grid given as a callable, positional arguments, a
kernel object that is not a compiled Triton kernel (the interpreter, ``TRITON_INTERPRET=1``,
returns none, so nothing is remembered), Triton before 3.3, no CUDA, or
``MEGATRON_SUBQ_FAST_LAUNCH=0`` (read per launch: an A/B knob). Default on.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
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


class _Plan:
    """How one call site's keyword order maps onto the kernel's parameters, made once per order
    (``tuple(kwargs)``): ``pick`` gathers every parameter in signature order from the kwargs'
    values followed by ``extra`` (the defaults not given), then the launch options given.
    Per distinct tuple of argument types, ``split`` caches which positions hold tensors and
    which hold scalars that key by value (everything but floats, which Triton specialises by
    type only)."""

    __slots__ = ("pick", "extra", "n", "split")

    def __init__(self, names: tuple, defaults: dict, order: tuple):
        if any(n not in names and n not in _OPTIONS for n in order):
            raise KeyError("an argument that is neither a parameter nor a launch option")
        pos = {n: i for i, n in enumerate(order)}
        extra, idx = [], []
        for n in names:
            if n in pos:
                idx.append(pos[n])
            else:  # KeyError when neither given nor defaulted: Triton's own error, plain path
                extra.append(defaults[n])
                idx.append(len(order) + len(extra) - 1)
        idx += [pos[o] for o in _OPTIONS if o in pos]
        self.pick = _getter(idx)
        self.extra = tuple(extra)
        self.n = len(names)
        self.split: dict = {}

    def positions(self, types: tuple):
        """(tensor positions, their getter, the getter of the by-value scalars) for ``types``."""
        got = self.split.get(types)
        if got is None:
            tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
            scalars = [i for i, t in enumerate(types)
                       if not issubclass(t, (torch.Tensor, float))]
            got = self.split[types] = (tuple(tensors), _getter(tensors), _getter(scalars))
        return got


def _getter(idx: list):
    """A function of a sequence returning the tuple of its items at ``idx`` (any length)."""
    if not idx:
        return lambda seq: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda seq: (seq[i],)
    return operator.itemgetter(*idx)


_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")
_PTR = torch.Tensor.data_ptr


def _active(hook):
    """The hook, or None when it is Triton's empty ``HookChain`` (>= 3.6: never None, so every
    launch would build the launch metadata for nothing)."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


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
        self.plans: Dict[tuple, _Plan] = {}

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

    def _plan(self, kwargs: dict) -> Optional[_Plan]:
        """The plan of this keyword order, made and remembered; None (the plain path, every
        time) for Triton before 3.3, a kernel without a Python signature, or an argument that
        is unknown or missing (Triton raises its own error)."""
        if _knobs() is None or not self._signature():
            return None
        try:
            plan = _Plan(self.names, self.defaults, tuple(kwargs))
        except KeyError:
            return None
        self.plans[tuple(kwargs)] = plan
        return plan

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def bind(self, grid: tuple, **fixed) -> "Bound":
        """A launch over ``grid`` with every argument but the tensors given here (``Bound``)."""
        return Bound(self, grid, fixed)

    def launch(self, grid, args: tuple, kwargs: dict):
        if args or callable(grid) or os.environ.get(ENV, "1") == "0" or not _cuda():
            return self.kernel[grid](*args, **kwargs)
        plan = self.plans.get(tuple(kwargs))
        if plan is None:
            plan = self._plan(kwargs)
            if plan is None:  # no fast path for this kernel or these arguments
                return self.kernel[grid](*args, **kwargs)
        picked = plan.pick((*kwargs.values(), *plan.extra))
        values = picked[:plan.n]  # the parameters in signature order; then the launch options
        types = tuple(map(type, values))
        tensor_pos, tensors_of, scalars_of = plan.positions(types)
        tensors = tensors_of(values)
        ptrs = tuple(map(_PTR, tensors))
        device = torch.cuda.current_device()
        try:  # the plan stands for the options given (its order), picked[n:] for their values
            key = (device, id(plan), picked[plan.n:], types, scalars_of(values),
                   tuple(map(_DTYPE, tensors)), tuple(map(_DEVICE, tensors)),
                   tuple(map(operator.and_, ptrs, itertools.repeat(15))))
            compiled = self.compiled.get(key)
        except TypeError:  # an unhashable constexpr: no key
            return self.kernel[grid](**kwargs)
        if compiled is None:
            return _remember(self.compiled, key, self.kernel[grid](**kwargs))
        return _relaunch(compiled, grid, device, list(values), tensor_pos, ptrs, tensors)


class Bound:
    """``fast(kernel).bind(grid, **fixed)``: ``kernel`` over ``grid`` with its non-tensor
    arguments (integers, strides, constexprs, Nones, launch options) given once; a call
    ``bound(**tensors)`` launches ``kernel[grid](**fixed, **tensors)``. The fixed part is keyed
    by the Bound itself, so a launch keys only on the tensors (dtype, device, data pointer mod
    16) and the current device, and fills their pointers into a prepared argument list: the
    per-launch host work of ``FastLaunch`` without re-reading ~30 fixed arguments (why: at
    2K tokens ASA's launches are host-bound, docs/benchmarks.md). The fixed dict must not be
    changed after binding; a caller keeps its Bounds per shape (e.g. ``functools.lru_cache``
    on the integers they are made from). The plain path, as ``FastLaunch``'s: a value among the
    tensors that is not a tensor, an unknown or missing argument, no CUDA, Triton before 3.3,
    ``MEGATRON_SUBQ_FAST_LAUNCH=0``, the interpreter (nothing compiled to remember)."""

    __slots__ = ("owner", "grid", "fixed", "plans", "compiled")

    def __init__(self, owner: FastLaunch, grid: tuple, fixed: dict):
        self.owner, self.grid, self.fixed = owner, tuple(grid), fixed
        self.plans: dict = {}
        self.compiled: dict = {}

    def _plan(self, order: tuple):
        """(the argument list in signature order with the tensors' slots empty, the tensors'
        slots in call order), or None: no fast path for these names."""
        owner = self.owner
        if _knobs() is None or not owner._signature():
            return None
        names, fixed = owner.names, self.fixed
        if any(n not in names for n in order) or any(
                n not in names and n not in _OPTIONS for n in fixed):
            return None
        pos = {n: i for i, n in enumerate(owner.names)}
        template = []
        for n in names:
            if n in fixed:
                template.append(fixed[n])
            elif n in order:
                template.append(None)
            elif n in owner.defaults:
                template.append(owner.defaults[n])
            else:  # neither given nor defaulted: Triton's own error
                return None
        return template, tuple(pos[n] for n in order)

    def __call__(self, **tensors):
        if os.environ.get(ENV, "1") == "0" or not _cuda():
            return self.owner.kernel[self.grid](**self.fixed, **tensors)
        order = tuple(tensors)
        plan = self.plans.get(order, False)
        if plan is False:
            plan = self.plans[order] = self._plan(order)
        if plan is None:
            return self.owner.kernel[self.grid](**self.fixed, **tensors)
        vals = tuple(tensors.values())
        try:
            ptrs = tuple(map(_PTR, vals))
        except (TypeError, AttributeError):  # not a tensor: Triton binds it
            return self.owner.kernel[self.grid](**self.fixed, **tensors)
        device = torch.cuda.current_device()
        key = (device, tuple(map(_DTYPE, vals)), tuple(map(_DEVICE, vals)),
               tuple(map(operator.and_, ptrs, itertools.repeat(15))))
        compiled = self.compiled.get(key)
        if compiled is None:
            return _remember(self.compiled, key,
                             self.owner.kernel[self.grid](**self.fixed, **tensors))
        template, slots = plan
        return _relaunch(compiled, self.grid, device, template.copy(), slots, ptrs, vals)


def _remember(store: dict, key: tuple, compiled):
    """Keep a kernel Triton compiled or found under ``key`` (at most ``MAX_KEYS`` per store;
    nothing when it is no compiled kernel: the interpreter's launch) and return it."""
    if (getattr(compiled, "run", None) is not None and hasattr(compiled, "function")
            and len(store) < MAX_KEYS):
        store[key] = compiled
    return compiled


def _relaunch(compiled, grid, device: int, args: list, slots, ptrs, tensors):
    """Launch ``compiled`` over ``grid`` with ``args`` (every parameter in signature order) after
    putting the tensors' data pointers into their ``slots``: as integers, the launcher neither
    calls data_ptr() nor asks the driver whether each is a device pointer
    (cuPointerGetAttribute); the callers' keys hold every tensor's device, and a tensor Triton
    refused never got a key. Launch hooks, when any is set, see the tensors, as Triton's do."""
    stream = _current_stream(device)
    hooks = _knobs()
    enter, leave = _active(hooks.launch_enter_hook), _active(hooks.launch_exit_hook)
    meta = None
    if enter is not None or leave is not None:
        seen = args.copy()
        for i, t in zip(slots, tensors):
            seen[i] = t
        meta = compiled.launch_metadata(grid, stream, *seen)
    for i, p in zip(slots, ptrs):
        args[i] = p
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *args)
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


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1) for host integers: ``triton.next_power_of_2``
    without its constexpr-function wrapper (~2 µs per call on the host)."""
    return 1 << (n - 1).bit_length()
