"""ASA's Triton kernels: chunked causal linear attention with the softmax feature maps fused.

``asa_attention_kernel`` is what ``megatron_subq.ops.asa_attention`` dispatches to for
``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). Decode steps use
``megatron_subq.ops.asa_decode_step`` (a few fused torch ops on the (S, z) state, in place).
"""

from ..lazy import lazy_attributes

# The Triton kernels load on first use (kernels/lazy.py); the names below import their module
# when first asked for.
_LAZY = {
    "ASAChunkFunction": ".function",
    "asa_attention_kernel": ".function",
    "kernel_supports": ".function",
    "kernel_verified": ".function",
}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["ASAChunkFunction", "asa_attention_kernel", "kernel_supports", "kernel_verified"]
