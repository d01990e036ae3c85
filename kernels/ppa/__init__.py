"""PPA's Triton kernels: dense tiles for the window band and close offsets, gathered diagonals
for the far power offsets; forward and backward (dq; dk/dv summed over each GQA group).

``ppa_attention_kernel`` is what ``megatron_subq.ops.ppa_attention`` dispatches to for
``impl="kernel"`` (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
"""

import importlib

# The Triton kernels load on first use (PEP 562), not with the package: the op imports this
# package's triton-free modules (plan.py) at its own import, before TRITON_INTERPRET may be set
# and where triton may be absent; the names below then import function.py when first asked for.
_LAZY = {
    "DENSE_GAP": ".function",
    "PPAFunction": ".function",
    "dense_reach": ".function",
    "offset_plan": ".function",
    "ppa_attention_kernel": ".function",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DENSE_GAP", "PPAFunction", "dense_reach", "offset_plan", "ppa_attention_kernel"]
