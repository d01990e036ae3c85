"""nonapprox's Triton kernels: a chunked causal softmax over time of one scalar per token.

``nonapprox_attention_kernel`` is what ``megatron_subq.ops.nonapprox_attention`` (and
``nonapprox_prefill``) dispatch to for ``impl="kernel"`` (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``). Decode steps use ``megatron_subq.ops.nonapprox_decode_step`` (a few
torch ops on the (num, den, max) state, in place).
"""

from ..lazy import lazy_attributes

# The Triton kernels load on first use (kernels/lazy.py); the names below import their module
# when first asked for.
_LAZY = {"NonapproxChunkFunction": ".function", "nonapprox_attention_kernel": ".function"}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["NonapproxChunkFunction", "nonapprox_attention_kernel"]
