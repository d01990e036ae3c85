"""Fused replacements for the slow parts of megatron-core's local (non-TE, non-apex) layer spec.

``rmsnorm``: RMSNorm forward and backward in one Triton kernel each (the weight gradient reduced
over rows in per-program partial sums), ``reference.py`` the readable PyTorch definition beside
it. ``megatron_subq.norm.FusedLocalNorm`` uses it (``--subq-fused-norm``).
``rope``: megatron's non-interleaved RoPE forward and backward, one Triton kernel each
(``--subq-fused-rope``, ``megatron_subq.rope``).
"""

from ..lazy import lazy_attributes

# reference.py is torch only; the Triton module loads on first use (kernels/lazy.py)
from .reference import rms_norm_reference, rope_reference  # noqa: F401

_LAZY = {
    "RMSNormFunction": ".rmsnorm",
    "rms_norm_kernel": ".rmsnorm",
    "rmsnorm_launch_config": ".rmsnorm",
    "RMSNormLaunchConfig": ".rmsnorm",
    "RoPEFunction": ".rope",
    "rope_kernel": ".rope",
    "rope_launch_config": ".rope",
    "RoPELaunchConfig": ".rope",
}
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = ["RMSNormFunction", "RMSNormLaunchConfig", "RoPEFunction", "RoPELaunchConfig",
           "rms_norm_kernel", "rms_norm_reference", "rmsnorm_launch_config", "rope_kernel",
           "rope_launch_config", "rope_reference"]
