"""Shared pieces of the kernel-versus-reference tests (tests/test_*_kernel.py).

Without CUDA the kernels run in Triton's interpreter on CPU tensors; ``TRITON_INTERPRET=1`` must be
set before triton is first imported (tests/conftest.py does it), because ``@triton.jit`` decides
at decoration time whether a kernel is compiled or interpreted.

Error measure of every kernel test: relative RMS, ``‖x − ref‖₂ / ‖ref‖₂`` per output, against the
fp32 reference computed from the same (rounded) inputs, with one bound per input dtype
(``BOUNDS``): fp32 arithmetic throughout (1e-5), fp16 operands with fp32 accumulation (3e-3), bf16
operands with their 8-bit mantissa (2e-2). Each test module states what it saw.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

from ..cuda_graphs import capture_cuda_graph

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖₂ / ‖ref‖₂ in float64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def kernel_package(name: str) -> ModuleType:
    """``megatron_subq.kernels.<name>``; on the CPU, check its kernels really are interpreted."""
    pkg = importlib.import_module(f"megatron_subq.kernels.{name}")
    for attr in pkg.__all__:  # the kernel modules load lazily: load them for the check below
        getattr(pkg, attr)
    if DEVICE == "cpu":
        from triton.runtime.jit import JITFunction  # noqa: PLC0415

        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(pkg.__name__):
                continue
            for obj in vars(mod).values():
                if isinstance(obj, JITFunction):
                    raise RuntimeError(
                        f"{mod_name} was compiled for a GPU: set TRITON_INTERPRET=1 before triton "
                        "is imported (tests/conftest.py does) to run the kernels on the CPU")
    return pkg


def count_calls(monkeypatch, module: ModuleType, names) -> dict:
    """Wrap ``module``'s functions ``names`` (pytest's monkeypatch undoes it) so that their calls
    are counted: a test then sees a launch option taken, where a numerical comparison alone
    would also pass with the option ignored. Returns the live ``{name: calls}`` dict."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*args, _name=name, _fn=getattr(module, name), **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def record_launches(monkeypatch, module: ModuleType, name: str) -> list:
    """Stand in for the Triton kernel ``module.name`` (launched as ``kernel[grid](...)``;
    pytest's monkeypatch undoes it) and record the keyword arguments of each launch, in order:
    a test then sees which kernels ran, how often, and with which constexprs (tiles, switches).
    Returns the live list of ``kwargs`` dicts."""
    kernel, launches = getattr(module, name), []

    class _Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, _Recorder())
    return launches


def graph_replay_matches_eager(fn, inputs, grad_out: torch.Tensor, seed: int = 0) -> dict:
    """Capture ``fn(*inputs)`` forward and backward in one CUDA graph (what a CUDA-graphed
    training step runs), put new values into the inputs, replay, and compare output and input
    gradients with an eager call on those values. A kernel that syncs with the host or reads a
    host value that changes between calls breaks the capture or the comparison. Returns the
    largest ``rel_rms`` per output name (``out``, ``grad0``...), which must be ≈ 0 (the same
    kernels on the same values; only atomics could reorder sums)."""

    def step():
        out = fn(*inputs)
        return (out,) + torch.autograd.grad(out, inputs, grad_out)

    graph, captured = capture_cuda_graph(step)
    g = torch.Generator(device=inputs[0].device).manual_seed(seed + 1)
    with torch.no_grad():
        for x in inputs:
            x.copy_(torch.randn(x.shape, generator=g, device=x.device, dtype=torch.float32))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    names = ["out"] + [f"grad{i}" for i in range(len(inputs))]
    return {n: rel_rms(c, e) for n, c, e in zip(names, captured, eager)}
