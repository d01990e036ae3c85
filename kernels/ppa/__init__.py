"""PPA's Triton kernels: dense tiles for the window band and close offsets, gathered diagonals
for the far power offsets; forward and backward (dq; dk/dv summed over each GQA group).

``ppa_attention_kernel`` is what ``megatron_subq.ops.ppa_attention`` dispatches to for
``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from ..lazy import lazy_attributes

# The Triton kernels load on first use (kernels/lazy.py); the names below import their module
# when first asked for.
_LAZY = {
    "DENSE_GAP": ".function",
    "PPAFunction": ".function",
    "dense_reach": ".function",
    "offset_plan": ".function",
    "ppa_attention_kernel": ".function",
}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["DENSE_GAP", "PPAFunction", "dense_reach", "offset_plan", "ppa_attention_kernel"]
