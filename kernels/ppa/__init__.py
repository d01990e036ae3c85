"""PPA's Triton kernels: dense tiles for the window band and close offsets, gathered diagonals
for the far power offsets; forward and backward (dq; dk/dv summed over each GQA group).

``ppa_attention_kernel`` is what ``megatron_subq.ops.ppa_attention`` dispatches to for
``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""

from .function import DENSE_GAP, PPAFunction, dense_reach, offset_plan, ppa_attention_kernel

__all__ = ["DENSE_GAP", "PPAFunction", "dense_reach", "offset_plan", "ppa_attention_kernel"]
