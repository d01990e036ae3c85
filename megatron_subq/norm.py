"""A torch-only RMSNorm/LayerNorm for megatron-core's local (non-TE) specs, sequence-parallel ready.

megatron-core's ``WrappedTorchNorm`` refuses sequence parallelism and its fused norm needs apex
(CUDA). Under SP each rank normalises its own sequence shard, so the norm weights see only part
of the tokens: they carry ``sequence_parallel=True`` and megatron's ``finalize_model_grads``
all-reduces their gradients over TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .parallel import mark_sequence_parallel


class LocalNorm(torch.nn.Module):
    """RMSNorm (default, Transformer++) or LayerNorm, per ``config.normalization``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"normalization={config.normalization!r} is invalid: allowed "
                             "'RMSNorm' or 'LayerNorm'")
        self.kind = config.normalization
        self.eps = eps
        self.hidden_size = hidden_size
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        init = 0.0 if self.zero_centered_gamma else 1.0
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=dtype))
        params = [self.weight]
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
            params.append(self.bias)
        mark_sequence_parallel(params, config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + 1.0 if self.zero_centered_gamma else self.weight
        # normalise in the wider of fp32 and the input's dtype: fp32 for bf16/fp16 activations,
        # as megatron's fused norms do, and float64 stays float64
        dtype = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(dtype)
        if self.kind == "RMSNorm":
            y = F.rms_norm(xf, (self.hidden_size,), w.to(dtype), self.eps)
        else:
            y = F.layer_norm(xf, (self.hidden_size,), w.to(dtype), self.bias.to(dtype), self.eps)
        return y.to(x.dtype)


class FusedLocalNorm(LocalNorm):
    """``LocalNorm``'s RMSNorm in one Triton kernel per direction (``kernels/fused/rmsnorm.py``):
    the same parameter, checkpoint keys and math (``rms_norm_reference``), chosen by
    ``config.subq_fused_norm`` (``--subq-fused-norm``) through ``slots.get_spec_provider``.

    The kernel runs on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU ones (tests);
    other CPU tensors take ``LocalNorm``'s torch path. With zero-centred gamma the ``+ 1`` is
    added in fp32 inside the kernel (``LocalNorm`` adds it in the weight's dtype first: equal
    in fp32, slightly more exact in bf16)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization != "RMSNorm":
            raise ValueError(f"subq_fused_norm=True is invalid with normalization="
                             f"{config.normalization!r}: the fused norm is RMSNorm only; allowed: "
                             "normalization='RMSNorm' or subq_fused_norm=False")
        super().__init__(config, hidden_size, eps, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .kernels.checks import triton_runs_on  # noqa: PLC0415

        if not triton_runs_on(x):
            return super().forward(x)
        from .kernels.fused import rms_norm_kernel  # noqa: PLC0415 (Triton loads on first use)

        return rms_norm_kernel(x, self.weight, self.eps, self.zero_centered_gamma)
