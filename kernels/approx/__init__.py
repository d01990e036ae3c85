"""approx's Triton kernels: the three-term chunked linear attention of the deconstructing-attention
paper (running mean + identity features + element-wise squares, each normalised separately).

``approx_attention_kernel`` is what ``megatron_subq.ops.approx_attention`` (and ``approx_prefill``)
dispatch to for ``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). Decode
steps use ``megatron_subq.ops.approx_decode_step`` (a few torch ops on the state, in place).
"""

from .function import ApproxChunkFunction, approx_attention_kernel, kernel_supports

__all__ = ["ApproxChunkFunction", "approx_attention_kernel", "kernel_supports"]
