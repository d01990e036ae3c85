"""nonapprox's decode state and its check, shared by the op (``megatron_subq.ops.nonapprox``:
reference, decode steps) and the kernel (``function.nonapprox_attention_kernel`` takes and returns
the state); no triton here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass
class NonapproxState:
    """The running softmax of one layer after ``length`` tokens, per sequence and query head.

    num: [B, H, D] = sum_j exp(s_j - max) v_j;  den: [B, H] = sum_j exp(s_j - max) (>= 1 once a
    token is in); max: [B, H] = max_j s_j (-inf before the first token). ``length`` is the
    decoder's position, not a cache entry. The tensors' dtype is the storage dtype.
    """

    num: torch.Tensor
    den: torch.Tensor
    max: torch.Tensor
    length: int = 0

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return (self.num, self.den, self.max)

    def nbytes(self) -> int:
        """Bytes kept for this layer (Table 8 counts these at 2 bytes per entry)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def check_state(op: str, state: NonapproxState, B: int, H: int, D: int) -> None:
    """``state`` must be a ``NonapproxState`` for ``B`` sequences, ``H`` heads of dim ``D``."""
    if not isinstance(state, NonapproxState):
        raise TypeError(f"{op}: state must be a NonapproxState, got {type(state).__name__}")
    if state.num.shape != (B, H, D):
        raise ValueError(f"{op}: state is for [B, H, D]={tuple(state.num.shape)}, got q with "
                         f"B={B}, H={H}, D={D}")
