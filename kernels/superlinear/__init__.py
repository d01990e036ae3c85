"""Superlinear attention's Triton kernels: search + top-k, span attention merged with the window
by log-sum-exp (pairs bucketed by key footprint), the gate; forward and backward for q, q_s, k, v
with GQA.

``superlinear_attention_kernel`` is what ``megatron_subq.ops.superlinear_attention`` dispatches to
for ``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
``superlinear_prefill_kernel`` (a chunk of queries against cached keys: the forward kernels with a
query offset) and ``superlinear_decode_kernel`` (``decode.py``: one query, split-K over the window
and the kept spans) serve ``ops.superlinear_prefill`` and ``ops.superlinear_decode_step``.
"""

import importlib

# The Triton kernels load on first use (PEP 562), not with the package: the op imports this
# package's triton-free modules (plan.py) at its own import, before TRITON_INTERPRET may be set
# and where triton may be absent; the names below then import decode.py and function.py when
# first asked for.
_LAZY = {
    "superlinear_decode_kernel": ".decode",
    "LaunchConfig": ".function",
    "SuperlinearSpanFunction": ".function",
    "launch_config": ".function",
    "search_topk": ".function",
    "span_bounds": ".function",
    "superlinear_attention_kernel": ".function",
    "superlinear_prefill_kernel": ".function",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
