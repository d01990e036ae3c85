"""SAS — Simulated Attention Score (sas-simulated-attention-score.txt, App. I), ``[B, T, H, D]``.

With ``Ĥ`` simulated heads (a multiple of H), ``D̂`` simulated q/k features and an odd kernel:

    q̂ = RMLP(Lin_{D→D̂}(RCNN(Conv_{H→Ĥ}(q))))      k̂: the same with its own weights
    v̂ = RCNN(Conv_{H→Ĥ}(v))                         (no feature expansion for v)
    RCNN(x) = x + Conv_{Ĥ→Ĥ}(ReLU(x))              RMLP(x) = x + Lin_{D̂→D̂}(ReLU(x))
    h_j = causal softmax attention of head j (q̂/k̂ dim D̂, scale 1/√D̂, v̂ dim D), j < Ĥ
    out_h = mean_g h_{g·H + h}                      (PEAA: the Ĥ/H groups of H heads averaged)

A head convolution is a ``Conv1d`` whose channels are the heads and which slides along the D
features of one token (``'same'`` padding), so kernel 1 is a linear map across heads at every
feature position. Simulated heads are numbered as in the paper: head ``j = g·H + h`` is in group
``g`` and averages into output head ``h``.

GQA: k and v with fewer heads are repeated to the H query heads first (``repeat_kv``, megatron's
contiguous groups), so the expansion weights have the same shapes as for multi-head attention.

The pieces (``head_conv``, ``simulate_heads``, ``simulate_features``, ``peaa``) are public because
the tensor-parallel module composes them on a subset of simulated heads
(``megatron_subq.variants.sas``); ``sas_attention`` is the whole layer core on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .dispatch import IMPLS, check_qkv, repeat_kv
from .standard import standard_attention

HeadIndex = Optional[Union[Sequence[int], torch.Tensor]]


@dataclass
class SASBranchWeights:
    """The weights of one expansion (of q, k or v), in torch's ``Conv1d`` / ``Linear`` layouts.

    conv_in:  ``[Ĥ, H, kernel]``      Conv_{H→Ĥ}
    conv_res: ``[n, Ĥ, kernel]``      the rows of RCNN's Conv_{Ĥ→Ĥ} producing the ``n`` simulated
                                      heads computed (all Ĥ, in order, unless ``heads`` is given)
    lin:      ``[D̂, D]`` or None      Lin_{D→D̂} (None for v: no feature expansion)
    lin_res:  ``[D̂, D̂]`` or None     RMLP's Lin_{D̂→D̂}
    ``*_bias``: the matching biases, or None (the default config has no biases).
    """

    conv_in: torch.Tensor
    conv_res: torch.Tensor
    lin: Optional[torch.Tensor] = None
    lin_res: Optional[torch.Tensor] = None
    conv_in_bias: Optional[torch.Tensor] = None
    conv_res_bias: Optional[torch.Tensor] = None
    lin_bias: Optional[torch.Tensor] = None
    lin_res_bias: Optional[torch.Tensor] = None


def head_conv(x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Conv1d with heads as channels, sliding along the features of each token.

    x: ``[B, T, C_in, D]``, weight: ``[C_out, C_in, kernel]`` (odd kernel, 'same' padding)
    -> ``[B, T, C_out, D]``.
    """
    B, T, C_in, D = x.shape
    out = F.conv1d(x.reshape(B * T, C_in, D), weight, bias, padding=(weight.shape[-1] - 1) // 2)
    return out.view(B, T, weight.shape[0], D)


def simulate_heads(x: torch.Tensor, conv_in: torch.Tensor, conv_res: torch.Tensor,
                   heads: HeadIndex = None, conv_in_bias: Optional[torch.Tensor] = None,
                   conv_res_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``RCNN(Conv_{H→Ĥ}(x))`` for the simulated heads ``heads`` (default: all Ĥ, in order).

    x: ``[B, T, H, D]``; conv_in: ``[Ĥ, H, k]``; conv_res: ``[len(heads), Ĥ, k]`` (its rows for
    ``heads``) -> ``[B, T, len(heads), D]``. Every simulated head of ``Conv_{H→Ĥ}`` is computed:
    the residual convolution reads all of them.
    """
    y = head_conv(x, conv_in, conv_in_bias)  # [B, T, Ĥ, D]
    skip = y if heads is None else y[:, :, heads]
    return skip + head_conv(F.relu(y), conv_res, conv_res_bias)


def simulate_features(x: torch.Tensor, lin: torch.Tensor, lin_res: torch.Tensor,
                      lin_bias: Optional[torch.Tensor] = None,
                      lin_res_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``RMLP(Lin_{D→D̂}(x))``: ``[..., D]`` -> ``[..., D̂]``."""
    z = F.linear(x, lin, lin_bias)
    return z + F.linear(F.relu(z), lin_res, lin_res_bias)


def expand(x: torch.Tensor, w: SASBranchWeights, heads: HeadIndex = None) -> torch.Tensor:
    """One branch: ``[B, T, H, D]`` -> ``[B, T, n, D̂]`` (q, k) or ``[B, T, n, D]`` (v)."""
    out = simulate_heads(x, w.conv_in, w.conv_res, heads, w.conv_in_bias, w.conv_res_bias)
    if w.lin is not None:
        out = simulate_features(out, w.lin, w.lin_res, w.lin_bias, w.lin_res_bias)
    return out


def peaa(o: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Parameter-efficient attention aggregation: ``[B, T, Ĥ, D]`` -> ``[B, T, H, D]``, the mean
    of the Ĥ/H groups of H consecutive simulated heads (head ``g·H + h`` goes to ``h``)."""
    B, T, n, D = o.shape
    if n % num_heads:
        raise ValueError(f"peaa: o has {n} heads, not a multiple of num_heads={num_heads}")
    return o.view(B, T, n // num_heads, num_heads, D).mean(dim=2)


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------
def _check_shape(op: str, name: str, t, shape: tuple, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {what} = {tuple(shape)}, "
                         f"got {tuple(t.shape)}")


def _check_branch(op: str, name: str, w: SASBranchWeights, H: int, D: int, n_out: Optional[int],
                  features: bool, like: torch.Tensor) -> tuple[int, Optional[int]]:
    """Check one branch's weights; return (Ĥ, D̂ or None)."""
    if not isinstance(w, SASBranchWeights):
        raise TypeError(f"{op}: {name} must be a SASBranchWeights, got {type(w).__name__}")
    if not isinstance(w.conv_in, torch.Tensor) or w.conv_in.dim() != 3:
        raise ValueError(f"{op}: {name}.conv_in must have shape [Ĥ, H, kernel]")
    sim_heads, kernel = w.conv_in.shape[0], w.conv_in.shape[2]
    if kernel % 2 == 0:
        raise ValueError(f"{op}: {name}.conv_in has kernel size {kernel}; allowed: odd sizes "
                         "('same' padding)")
    _check_shape(op, f"{name}.conv_in", w.conv_in, (sim_heads, H, kernel), "[Ĥ, H, kernel]")
    n_out = sim_heads if n_out is None else n_out
    _check_shape(op, f"{name}.conv_res", w.conv_res, (n_out, sim_heads, kernel),
                 "[heads computed, Ĥ, kernel]")
    _check_bias(op, f"{name}.conv_in_bias", w.conv_in_bias, sim_heads)
    _check_bias(op, f"{name}.conv_res_bias", w.conv_res_bias, n_out)
    sim_dim = None
    if features:
        if not isinstance(w.lin, torch.Tensor) or w.lin.dim() != 2 or w.lin.shape[1] != D:
            got = None if w.lin is None else tuple(w.lin.shape)
            raise ValueError(f"{op}: {name}.lin must have shape [D̂, D={D}], got {got}")
        sim_dim = w.lin.shape[0]
        _check_shape(op, f"{name}.lin_res", w.lin_res, (sim_dim, sim_dim), "[D̂, D̂]")
        _check_bias(op, f"{name}.lin_bias", w.lin_bias, sim_dim)
        _check_bias(op, f"{name}.lin_res_bias", w.lin_res_bias, sim_dim)
    elif w.lin is not None or w.lin_res is not None:
        raise ValueError(f"{op}: {name}.lin and {name}.lin_res must be None (SAS does not expand "
                         "the value features)")
    for field in ("conv_in", "conv_res", "lin", "lin_res"):
        t = getattr(w, field)
        if t is not None and (t.dtype != like.dtype or t.device != like.device):
            raise ValueError(f"{op}: {name}.{field} is {t.dtype} on {t.device}; the inputs are "
                             f"{like.dtype} on {like.device}")
    return sim_heads, sim_dim


def _check_bias(op: str, name: str, b, size: int) -> None:
    if b is not None:
        _check_shape(op, name, b, (size,), "[channels]")


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------
def sas_expand_qkv(q, k, v, wq: SASBranchWeights, wk: SASBranchWeights, wv: SASBranchWeights,
                   heads: HeadIndex = None, op: str = "sas_attention"):
    """The simulated heads ``heads`` (default all Ĥ) of q, k, v, checked: ``(q̂ [B, T, n, D̂],
    k̂ [B, T, n, D̂], v̂ [B, T, n, D], D̂)``. Each token is expanded on its own, so a decode
    cache may keep k̂, v̂ (``SASCoreAttention.attend_cached``)."""
    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    n_out = None if heads is None else len(heads)
    sim_heads, q_dim = _check_branch(op, "wq", wq, H, D, n_out, True, q)
    for name, w, features in (("wk", wk, True), ("wv", wv, False)):
        h_w, d_w = _check_branch(op, name, w, H, D, n_out, features, q)
        if h_w != sim_heads:
            raise ValueError(f"{op}: {name}.conv_in has {h_w} simulated heads, wq.conv_in "
                             f"{sim_heads}; they must agree")
        if features and d_w != q_dim:
            raise ValueError(f"{op}: wk.lin gives D̂={d_w}, wq.lin D̂={q_dim}; they must agree")
    q_hat = expand(q, wq, heads)  # [B, T, n, D̂]
    k_hat = expand(repeat_kv(k, H), wk, heads)  # [B, T, n, D̂]
    v_hat = expand(repeat_kv(v, H), wv, heads)  # [B, T, n, D]
    return q_hat, k_hat, v_hat, q_dim


def sas_simulated_attention(q, k, v, wq: SASBranchWeights, wk: SASBranchWeights,
                            wv: SASBranchWeights, heads: HeadIndex = None,
                            scale: Optional[float] = None, impl: Optional[str] = None):
    """The outputs of the simulated heads ``heads`` (default all Ĥ), before PEAA.

    q: ``[B, T, H, D]``; k, v: ``[B, T, H_kv, D]`` (H % H_kv == 0). ``heads``: indices in the
    paper's numbering (``conv_res`` then holds just their rows). Returns ``[B, T, n, D]``.
    ``scale`` defaults to 1/√D̂. ``impl`` goes to ``standard_attention`` (the softmax attention):
    ``"reference"`` is the explicit O(T²) form, None/"kernel" torch's SDPA.
    """
    op = "sas_attention"
    if impl not in (None,) + IMPLS:
        raise ValueError(f"{op}: impl={impl!r} is not one of {(None,) + IMPLS}")
    q_hat, k_hat, v_hat, q_dim = sas_expand_qkv(q, k, v, wq, wk, wv, heads, op)
    scale = 1.0 / math.sqrt(q_dim) if scale is None else scale
    return standard_attention(q_hat, k_hat, v_hat, causal=True, scale=scale,
                              impl="reference" if impl == "reference" else None)


def sas_attention(q, k, v, wq: SASBranchWeights, wk: SASBranchWeights, wv: SASBranchWeights,
                  scale: Optional[float] = None, impl: Optional[str] = None):
    """SAS attention on one device: expansion, causal attention over Ĥ heads, PEAA.

    q: ``[B, T, H, D]``; k, v: ``[B, T, H_kv, D]``; weights as ``SASBranchWeights`` (the
    simulated head count Ĥ must be a multiple of H). Returns ``[B, T, H, D]`` (before the output
    projection).
    """
    H = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if H is not None and isinstance(wq, SASBranchWeights) and wq.conv_in.shape[0] % H:
        raise ValueError(f"sas_attention: wq.conv_in has {wq.conv_in.shape[0]} simulated heads, "
                         f"not a multiple of the {H} query heads (PEAA averages groups of H)")
    out = sas_simulated_attention(q, k, v, wq, wk, wv, scale=scale, impl=impl)
    return peaa(out, q.shape[2])
