"""Argument checks shared by the Mamba-2 ops: each refuses bad input with a ValueError naming the
argument and what is allowed, before anything is computed."""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def _shape(t) -> Tuple[int, ...]:
    return tuple(t.shape)


def check_ssd_inputs(op: str, x, dt, A, B, C, D=None, dt_bias=None,
                     state: Optional[torch.Tensor] = None, *, token_dim: bool = True):
    """Check the SSD operands; return ``(batch, T, H, P, G, N)`` (``T`` is 1 when
    ``token_dim=False``, the one-token layouts of ``ssd_step``)."""
    def bad(name, value, allowed):
        raise ValueError(f"{op}: {name} has shape {value}; expected {allowed}")

    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    lead = 2 if token_dim else 1
    if x.dim() != lead + 2:
        bad("x", _shape(x), "[B, T, H, P]" if token_dim else "[B, H, P]")
    batch, H, P = x.shape[0], x.shape[-2], x.shape[-1]
    T = x.shape[1] if token_dim else 1
    prefix = _shape(x)[:lead]
    if _shape(dt) != prefix + (H,):
        bad("dt", _shape(dt), f"{list(prefix + (H,))} (x's leading dims and heads)")
    if _shape(A) != (H,):
        bad("A", _shape(A), f"[{H}] (one per head)")
    if B.dim() != lead + 2 or _shape(B)[:lead] != prefix:
        bad("B", _shape(B), f"{list(prefix)} + [G, N]")
    G, N = B.shape[-2], B.shape[-1]
    if _shape(C) != _shape(B):
        bad("C", _shape(C), f"B's shape {list(_shape(B))}")
    if G < 1 or H % G:
        raise ValueError(f"{op}: heads H={H} must be a multiple of the groups G={G} of B and C")
    if D is not None and _shape(D) not in ((H,), (H, P)):
        bad("D", _shape(D), f"[{H}] or [{H}, {P}]")
    if dt_bias is not None and _shape(dt_bias) != (H,):
        bad("dt_bias", _shape(dt_bias), f"[{H}]")
    if state is not None and _shape(state) != (batch, H, P, N):
        bad("state", _shape(state), f"[{batch}, {H}, {P}, {N}] ([B, H, P, N])")
    return batch, T, H, P, G, N


def check_chunk_size(op: str, chunk_size) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size={chunk_size!r} is invalid: allowed an integer >= 1")
    return chunk_size


def check_conv_inputs(op: str, x, weight, bias=None, state=None, *, token_dim: bool = True):
    """Check the depthwise-conv operands; return ``(batch, channels, width)``."""
    if x.dim() != (3 if token_dim else 2):
        raise ValueError(f"{op}: x has shape {_shape(x)}; expected "
                         f"{'[B, T, C]' if token_dim else '[B, C]'}")
    batch, channels = x.shape[0], x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 1:
        raise ValueError(f"{op}: weight has shape {_shape(weight)}; expected [{channels}, W] "
                         "(one filter of width W >= 1 per channel)")
    width = weight.shape[1]
    if bias is not None and _shape(bias) != (channels,):
        raise ValueError(f"{op}: bias has shape {_shape(bias)}; expected [{channels}]")
    if state is not None and _shape(state) != (batch, channels, width):
        raise ValueError(f"{op}: conv state has shape {_shape(state)}; expected "
                         f"[{batch}, {channels}, {width}] ([B, C, W])")
    return batch, channels, width


def check_activation(op: str, activation):
    if activation not in (None, "silu"):
        raise ValueError(f"{op}: activation={activation!r} is invalid: allowed None or 'silu'")
