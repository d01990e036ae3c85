"""Superlinear attention's Triton kernels: search + top-k, span attention merged with the window
by log-sum-exp (pairs bucketed by key footprint), the gate; forward and backward for q, q_s, k, v
with GQA.

``superlinear_attention_kernel`` is what ``megatron_subq.ops.superlinear_attention`` dispatches to
for ``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from .function import (LaunchConfig, SuperlinearSpanFunction, launch_config, search_topk,
                       span_bounds, superlinear_attention_kernel)

__all__ = ["LaunchConfig", "SuperlinearSpanFunction", "launch_config", "search_topk",
           "span_bounds", "superlinear_attention_kernel"]
