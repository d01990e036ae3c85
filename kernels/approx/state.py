"""approx's decode state and the checks of its arguments, shared by the op
(``megatron_subq.ops.approx``: reference, decode steps) and the kernel
(``function.approx_attention_kernel`` takes and returns the state); no triton here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


def check_eps(op: str, eps: float) -> None:
    """``eps`` (the denominators' guard) must be a positive number; ValueError naming ``op``."""
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"{op}: eps={eps!r} is invalid: allowed a positive number")


@dataclass
class ApproxState:
    """Running sums of one layer after ``length`` tokens, per sequence and key/value head.

    sum_v, sum_k1, sum_k2: [B, H_kv, D]    (sum v, sum k~, sum phi(k~))
    kv1, kv2:              [B, H_kv, D, D] (sum k~^T v, sum phi(k~)^T v)
    ``length`` (the token count, shared by the batch) is the decoder's position, not a cache entry.
    The tensors' dtype is the storage dtype; updates are computed in the accumulation dtype.
    """

    sum_v: torch.Tensor
    sum_k1: torch.Tensor
    sum_k2: torch.Tensor
    kv1: torch.Tensor
    kv2: torch.Tensor
    length: int = 0

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return (self.sum_v, self.sum_k1, self.sum_k2, self.kv1, self.kv2)

    def nbytes(self) -> int:
        """Bytes kept for this layer (Table 8 counts these at 2 bytes per entry)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def check_state(op: str, state: ApproxState, B: int, H_kv: int, D: int) -> None:
    """``state`` must be an ``ApproxState`` for ``B`` sequences, ``H_kv`` heads of dim ``D``."""
    if not isinstance(state, ApproxState):
        raise TypeError(f"{op}: state must be an ApproxState, got {type(state).__name__}")
    if state.kv1.shape != (B, H_kv, D, D):
        raise ValueError(f"{op}: state is for [B, H_kv, D]={tuple(state.sum_v.shape)}, got k/v "
                         f"with B={B}, H_kv={H_kv}, D={D}")
