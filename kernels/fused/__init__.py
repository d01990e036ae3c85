"""Fused replacements for the slow parts of megatron-core's local (non-TE, non-apex) layer spec.

``rmsnorm``: RMSNorm forward and backward in one Triton kernel each (the weight gradient reduced
over rows in per-program partial sums), ``reference.py`` the readable PyTorch definition beside
it. ``megatron_subq.norm.FusedLocalNorm`` uses it (``--subq-fused-norm``).
"""

from ..lazy import lazy_attributes

# reference.py is torch only; the Triton module loads on first use (kernels/lazy.py)
from .reference import rms_norm_reference  # noqa: F401

_LAZY = {
    "RMSNormFunction": ".rmsnorm",
    "rms_norm_kernel": ".rmsnorm",
    "rmsnorm_launch_config": ".rmsnorm",
    "RMSNormLaunchConfig": ".rmsnorm",
}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["RMSNormFunction", "RMSNormLaunchConfig", "rms_norm_kernel", "rms_norm_reference",
           "rmsnorm_launch_config"]
