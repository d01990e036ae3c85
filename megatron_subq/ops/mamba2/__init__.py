"""Mamba-2 (SSD) ops in plain PyTorch: the pieces of megatron's ``MambaMixer`` that otherwise need
``mamba_ssm``'s Triton kernels and ``causal_conv1d``'s CUDA ones.

Layouts (batch first, as mamba_ssm's and fla's ops):

=================  ==================  ===============================================
x, y               ``[B, T, H, P]``    P = head dim (``mamba_head_dim``)
dt                 ``[B, T, H]``       raw: the op adds ``dt_bias`` and takes softplus
A                  ``[H]``             negative (the mixer passes ``-exp(A_log)``)
B, C               ``[B, T, G, N]``    G groups, H % G == 0; head h reads group h // (H/G)
D                  ``[H]`` or ``[H, P]``
dt_bias            ``[H]``
SSM state          ``[B, H, P, N]``    N = state dim (``mamba_state_dim``); megatron's layout
conv input         ``[B, T, C]``       channels last; C = the [x | B | C] channels
conv weight        ``[C, W]``          depthwise, width W (``d_conv``)
conv state         ``[B, C, W]``       the last W inputs, oldest first; megatron's layout
=================  ==================  ===============================================

* ``ssd_naive``: the definition, token by token (tests compare against it).
* ``ssd_chunk``: the chunked scan (intra-chunk quadratic form + state passing between chunks),
  what the mixer trains with; initial state in, final state out.
* ``ssd_step``: one decode token.
* ``causal_conv1d`` / ``causal_conv1d_step``: the depthwise causal conv (+ SiLU) over a sequence
  and for one token.
* ``gated_rms_norm``: RMSNorm over groups of ``y * silu(z)``.

All accumulate in float32 (float64 for float64 inputs) and return outputs in the input dtype.
"""

from .chunk import DEFAULT_CHUNK_SIZE, ssd_chunk
from .conv import causal_conv1d, causal_conv1d_step
from .naive import ssd_naive
from .norm import gated_rms_norm
from .step import ssd_step

__all__ = ["DEFAULT_CHUNK_SIZE", "causal_conv1d", "causal_conv1d_step", "gated_rms_norm",
           "ssd_chunk", "ssd_naive", "ssd_step"]
