"""Superlinear attention's Triton kernels: search + top-k, span attention merged with the window
by log-sum-exp (pairs bucketed by key footprint), the gate; forward and backward for q, q_s, k, v
with GQA.

Files by concern: ``plan.py`` (geometry and the cached device plans; triton-free), ``launch.py``
(``LaunchConfig``, ``launch_config``, ``launch_options``), ``search.py`` (search + top-k, the
gate), ``span.py`` (span and window attention, forward and backward), ``function.py`` (the
autograd Functions and the training and prefill entry points), ``decode.py`` (the decode step)
and ``kernels.py`` (the ``@triton.jit`` kernels of all but the decode step).

``superlinear_attention_kernel`` is what ``megatron_subq.ops.superlinear_attention`` dispatches to
for ``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
``superlinear_prefill_kernel`` (a chunk of queries against cached keys: the forward kernels with a
query offset) and ``superlinear_decode_kernel`` (``decode.py``: one query, split-K over the window
and the kept spans) serve ``ops.superlinear_prefill`` and ``ops.superlinear_decode_step``.
"""

from ..lazy import lazy_attributes

# The Triton kernels load on first use (kernels/lazy.py); the names below import their module
# when first asked for.
_LAZY = {
    "superlinear_decode_kernel": ".decode",
    "SuperlinearDecodePlan": ".decode",
    "LaunchConfig": ".launch",
    "SuperlinearSpanFunction": ".function",
    "launch_config": ".launch",
    "search_topk": ".search",
    "span_bounds": ".span",
    "superlinear_attention_kernel": ".function",
    "superlinear_prefill_kernel": ".function",
}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = list(_LAZY)
