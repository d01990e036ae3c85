"""ASA's Triton kernels: chunked causal linear attention with the softmax feature maps fused.

``asa_attention_kernel`` is what ``megatron_subq.ops.asa_attention`` dispatches to for
``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). Decode steps use
``megatron_subq.ops.asa_decode_step`` (a few fused torch ops on the (S, z) state, in place).
"""

import importlib

# The Triton kernels load on first use (PEP 562), not with the package: the op imports this
# package's triton-free modules (state.py) at its own import, before TRITON_INTERPRET may be set
# and where triton may be absent; the names below then import function.py when first asked for.
_LAZY = {
    "ASAChunkFunction": ".function",
    "asa_attention_kernel": ".function",
    "kernel_supports": ".function",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ASAChunkFunction", "asa_attention_kernel", "kernel_supports"]
