"""The package's layering (docs/architecture.md, "Where things live" and "Kernels"), read from the
source with ``ast``, and the once-per-call argument checks it allows.

* ``kernels/`` is the bottom layer: it imports nothing of ``megatron_subq``; the ops import the
  kernels' triton-free modules (checks, powers, plans, state types), never the other way round.
* runtime code (the trainer, tools) does not import the test harness ``megatron_subq.testing``.
* no import cycle among the package's modules, lazy (function-level) imports included.
* an op checks ``power`` and ``cu_seqlens`` once and hands them to its kernel (one host sync).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _modules():
    """{dotted module name: path} of the installed layout (``kernels/`` as megatron_subq.kernels)."""
    out = {}
    for base, prefix in ((ROOT / "megatron_subq", "megatron_subq"),
                         (ROOT / "kernels", "megatron_subq.kernels")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _imports(name: str, path: Path):
    """(line, imported module, names) of every import in the file, at any depth, resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield node.lineno, module, tuple(a.name for a in node.names)


def test_kernels_import_nothing_of_the_package():
    """kernels/ is installed as megatron_subq.kernels but is the bottom layer: an import of
    ``megatron_subq.<anything outside kernels>``, absolute or relative, is a climb back up."""
    climbs = []
    for name, path in _modules().items():
        if not name.startswith("megatron_subq.kernels"):
            continue
        for line, module, _ in _imports(name, path):
            if module.startswith("megatron_subq") and not (
                    module == "megatron_subq.kernels" or module.startswith("megatron_subq.kernels.")):
                climbs.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not climbs, "\n".join(climbs)


def test_runtime_code_does_not_import_the_test_harness():
    """The trainer and the tools use runtime modules (megatron_subq.cpu, .distributed,
    .cuda_graphs); ``megatron_subq.testing`` is for tests only."""
    offenders = []
    runtime = {n: p for n, p in _modules().items()
               if n.startswith("megatron_subq.training") or n == "megatron_subq"}
    runtime["tools.bench_ops"] = ROOT / "tools" / "bench_ops.py"
    for name, path in runtime.items():
        for line, module, _ in _imports(name, path):
            if module.startswith("megatron_subq.testing"):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_no_import_cycle_in_the_package():
    """Every import between the package's modules (lazy ones too, ``from pkg import submodule``
    resolved to the submodule) forms no cycle: e.g. attention.py asking the variants registry
    while the variants import attention.py, or a kernel importing back from its op."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for _, module, names in _imports(name, path):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            if not targets and module in modules:
                targets = [module]
            graph[name].update(t for t in targets if t != name)
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_the_ops_import_and_run_without_triton():
    """The kernels' triton-free modules (checks, powers, plans, states) are all the ops import:
    with triton unimportable the package imports, the references run, and ``impl="kernel"``
    gets the op's clear error. The Triton modules load only when a kernel is first used."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, megatron_subq\n"
            "from megatron_subq import ops\n"
            "q = torch.randn(1, 8, 2, 4)\n"
            "ops.ppa_attention(q, q, q, 0.5, 2); ops.superlinear_attention(q, q, q, q)\n"
            "try:\n"
            "    ops.ppa_attention(q, q, q, 0.5, 2, impl='kernel')\n"
            "except ValueError as e:\n"
            "    assert 'no kernel is available' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('impl=kernel ran without triton')\n"
            "heavy = [m for m in sys.modules if m.startswith('megatron_subq.kernels.')\n"
            "         and m.rsplit('.', 1)[1] in ('function', 'kernels', 'chunk', 'decode')]\n"
            "assert not heavy, heavy\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


def _count_host_reads(monkeypatch, tensor):
    """Count ``tensor.tolist()`` calls (a host sync on a GPU tensor). Only outermost calls count:
    under a torch function mode (the CPU fallbacks another test may have installed in this
    process) the original ``tolist`` dispatches through the patched attribute again."""
    calls, active = [], []
    tolist = torch.Tensor.tolist

    def counted(self, *args, **kwargs):
        if self is tensor and not active:
            calls.append(1)
        active.append(1)
        try:
            return tolist(self, *args, **kwargs)
        finally:
            active.pop()

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return calls


def test_ppa_checks_power_and_cu_seqlens_once_per_call(monkeypatch):
    """ops.ppa_attention validates ``power`` (one Fraction conversion) and reads ``cu_seqlens``
    once; the kernel takes both as handed over (before: twice each per call)."""
    pytest.importorskip("triton")
    from megatron_subq.kernels.ppa import function as kernel_fn
    from megatron_subq.ops import ppa as ppa_op

    fractions = []
    for module in (ppa_op, kernel_fn):
        original = module.ppa_power_fraction

        def counted(*args, _original=original, **kwargs):
            fractions.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "ppa_power_fraction", counted)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    reads = _count_host_reads(monkeypatch, cu)
    out = ppa_op.ppa_attention(q, k, v, 0.5, 2, impl="kernel", cu_seqlens=cu)
    assert (len(fractions), len(reads)) == (1, 1)
    ref = ppa_op.ppa_attention(q, k, v, 0.5, 2, impl="reference", cu_seqlens=cu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert len(reads) == 2  # the reference path reads the boundaries once too


def test_asa_reads_cu_seqlens_once_per_call(monkeypatch):
    """ops.asa_attention hands the boundaries it checked to the kernel (``seq_bounds``) instead
    of the kernel reading ``cu_seqlens`` from the device a second time."""
    pytest.importorskip("triton")
    from megatron_subq import ops

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(3))
    p_q, p_k = (torch.randn(2, 16, 32, generator=g) for _ in range(2))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    reads = _count_host_reads(monkeypatch, cu)
    out = ops.asa_attention(q, k, v, p_q, p_k, impl="kernel", cu_seqlens=cu)
    assert len(reads) == 1
    ref = ops.asa_attention(q, k, v, p_q, p_k, impl="reference", cu_seqlens=cu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
