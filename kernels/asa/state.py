"""ASA's recurrent state type, shared by the op (``megatron_subq.ops.asa``: reference, decode
steps) and the kernel (``function.asa_attention_kernel`` returns it); no triton here."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ASAState(NamedTuple):
    """The recurrent state after some tokens: ``S = Σ k'ᵀ v`` ``[B, H, m, Dv]`` and ``z = Σ k'``
    ``[B, H, m]``, per query head, in the accumulation dtype (fp32; fp64 for fp64 inputs)."""

    S: torch.Tensor
    z: torch.Tensor
