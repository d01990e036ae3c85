"""Superlinear attention's Triton kernels: search + top-k, span attention merged with the window
by log-sum-exp (pairs bucketed by key footprint), the gate; forward and backward for q, q_s, k, v
with GQA.

``superlinear_attention_kernel`` is what ``megatron_subq.ops.superlinear_attention`` dispatches to
for ``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
``superlinear_prefill_kernel`` (a chunk of queries against cached keys: the forward kernels with a
query offset) and ``superlinear_decode_kernel`` (``decode.py``: one query, split-K over the window
and the kept spans) serve ``ops.superlinear_prefill`` and ``ops.superlinear_decode_step``.
"""

from .decode import superlinear_decode_kernel
from .function import (LaunchConfig, SuperlinearSpanFunction, launch_config, search_topk,
                       span_bounds, superlinear_attention_kernel, superlinear_prefill_kernel)

__all__ = ["LaunchConfig", "SuperlinearSpanFunction", "launch_config", "search_topk",
           "span_bounds", "superlinear_attention_kernel", "superlinear_decode_kernel",
           "superlinear_prefill_kernel"]
