"""The all-to-all context-parallel layout as it was before issue 24: the reference that the
packed exchange of ``megatron_subq.attention`` (``qkv_sequence_to_heads`` /
``heads_to_sequence``) is tested against bitwise (tests/test_cp_exchange.py) and timed against
(tools/bench_cp_layout.py). Not used by any model.

Per tensor and direction it makes three full copies (the exchange buffer, the
``all_to_all_single``, the zig-zag chunk reorder) plus a fourth for key/value heads fewer than
the CP size (``replicate_kv_heads``); its backward goes through autograd's views of the
reorder (a full-size gradient per chunk, summed: 4·cp passes per tensor in all)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.utils import get_pg_size

from ..attention import zigzag_chunks


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 (one equal slice per rank); its adjoint is itself."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _reorder_chunks(x: torch.Tensor, order) -> torch.Tensor:
    """x [s, ...] seen as len(order) equal chunks along dim 0 -> chunks ``order[0], order[1], ..``."""
    chunks = x.view(len(order), x.shape[0] // len(order), *x.shape[1:])
    return torch.cat([chunks[i] for i in order])


def replicate_kv_heads(x: torch.Tensor, cp: int) -> torch.Tensor:
    """Key/value heads ``[s, b, g, d]`` repeated to ``cp`` heads when g < cp (each head's
    copies adjacent); unchanged otherwise."""
    g = x.shape[2]
    return x if g >= cp else x.repeat_interleave(cp // g, dim=2)


def sequence_to_heads(x: torch.Tensor, group, stacks: int = 1) -> torch.Tensor:
    """``[s/cp, b, stacks·h, d]`` (zig-zag sequence shard, all heads) -> ``[s, b, stacks·h/cp,
    d]`` (whole sequence in natural order, this rank's slice ``h/cp`` of each stack)."""
    cp = get_pg_size(group)
    s_local, b, heads, d = x.shape
    h = heads // stacks
    x = x.view(s_local, b, stacks, cp, h // cp, d).permute(3, 0, 1, 2, 4, 5)
    x = _AllToAll.apply(x, group)  # [cp (source rank), s/cp, b, stacks, h/cp, d]
    x = x.reshape(cp * s_local, b, stacks * (h // cp), d)
    natural = [zigzag_chunks(cp).index(c) for c in range(2 * cp)]
    return _reorder_chunks(x, natural)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``sequence_to_heads`` (one stack): ``[s, b, h/cp, d]`` natural order ->
    ``[s/cp, b, h, d]`` this rank's zig-zag shard."""
    cp = get_pg_size(group)
    s, b, h, d = x.shape
    x = _reorder_chunks(x, zigzag_chunks(cp)).view(cp, s // cp, b, h, d)
    x = _AllToAll.apply(x, group)  # [cp (head slice), s/cp, b, h/cp, d]
    return x.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * h, d)


def reference_exchange(q, k, v, group, attend, stacks: int = 1) -> torch.Tensor:
    """The pre-issue-24 composition around ``attend`` (``[s, b, h, d]`` in, out): q/k/v
    ``[s/cp, b, heads, d]`` zig-zag -> heads -> ``attend`` -> ``[s/cp, b, h, d]``."""
    cp = get_pg_size(group)
    q = sequence_to_heads(q, group, stacks)
    k, v = (sequence_to_heads(replicate_kv_heads(x, cp), group) for x in (k, v))
    return heads_to_sequence(attend(q, k, v), group)
