"""approx's Triton kernels: the three-term chunked linear attention of the deconstructing-attention
paper (running mean + identity features + element-wise squares, each normalised separately).

``approx_attention_kernel`` is what ``megatron_subq.ops.approx_attention`` (and ``approx_prefill``)
dispatch to for ``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). Decode
steps use ``megatron_subq.ops.approx_decode_step`` (a few torch ops on the state, in place).
"""

from ..lazy import lazy_attributes

# The Triton kernels load on first use (kernels/lazy.py); the names below import their module
# when first asked for.
_LAZY = {
    "ApproxChunkFunction": ".function",
    "approx_attention_kernel": ".function",
    "kernel_supports": ".function",
}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["ApproxChunkFunction", "approx_attention_kernel", "kernel_supports"]
