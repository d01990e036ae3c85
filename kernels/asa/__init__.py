"""ASA's Triton kernels: chunked causal linear attention with the softmax feature maps fused.

``asa_attention_kernel`` is what ``megatron_subq.ops.asa_attention`` dispatches to for
``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). Decode steps use
``megatron_subq.ops.asa_decode_step`` (a few fused torch ops on the (S, z) state, in place).
"""

from .function import ASAChunkFunction, asa_attention_kernel, kernel_supports

__all__ = ["ASAChunkFunction", "asa_attention_kernel", "kernel_supports"]
