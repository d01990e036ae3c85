"""The shared core-attention module: Megatron's ``[s, b, h, d]`` on one side, an op on the other.

A variant that only changes the attention core subclasses ``SubqCoreAttention`` and implements
``attend(q, k, v)`` on ``[B, T, H, D]`` tensors (the layout of ``megatron_subq.ops``); the layout
conversion, the causal-only check and the TP head bookkeeping live here once. Such a module plugs
into megatron's ``SelfAttention`` as ``core_attention`` (GPTModel, and MambaStack's attention
slot, alike).

Process groups: megatron's ``SelfAttention`` hands its ``pg_collection`` to the core; the core
keeps it (``self.pg_collection``, ``self.tp_group``) and gives ``tp_group`` to what it builds
(head-sharded parameters, SAS's head gather). Built without one (a test, a script), it takes
megatron's global groups (``parallel.process_groups``).

Masks: every variant is causal by definition, so the causal ``attention_mask`` that megatron
passes is implied and not read. Packed sequences (megatron's ``packed_seq_params`` in the THD
layout: one row of documents back to back, ``cu_seqlens`` marking where each starts) run each
document as its own causal sequence: through the op's own ``cu_seqlens`` (asa, ppa) or one
``attend`` per document (the default ``attend_packed``; every variant is causal per sequence).
Which variants take them is the registry's ``Variant.packed_sequences``; the Q/K-source variants,
the only ones that do not, refuse them in their own attention and model.

Context parallelism (``Variant.context_parallel == "all_to_all"``, ``pg_collection.cp`` of N > 1
ranks): q/k/v arrive sequence-sharded ``[s/N, b, heads, d]`` in megatron's zig-zag order (rank r
holds chunks r and 2N-1-r of 2N). ``forward`` exchanges them over the CP group (all-to-all) for
``[s, b, heads/N, d]`` with the tokens landing in natural order (``qkv_sequence_to_heads``: q,
k and v in one exchange), runs the variant's full-sequence ``attend`` on its share of the heads,
and exchanges the output back (``heads_to_sequence``); autograd runs the exchanges backwards.
2 - 1/N full passes per tensor each way (the peers' share: a packing copy and the transfer;
the own share: one copy). Key/value heads fewer than N are replicated (as megatron does for
TP) by that packing copy; per-head parameters of a variant are read through ``cp_heads`` (this
CP rank's rows).

Decoding (docs/inference.md): with megatron's static inference context, ``SubqSelfAttention``
(variants/standard.py) hands the context and the chunk's first position to the core
(``bind_decode``) instead of filling megatron's KV cache; the core's next ``forward`` then keeps
the layer's own cache in ``context.key_value_memory_dict[layer_number]`` (``new_decode_cache`` at
position 0) and runs ``attend_cached`` on the new tokens only: a KV cache (``KVCache``) or a
recurrent state, as the variant's ``Variant.decode_cache`` says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_pg_rank, get_pg_size

from .parallel import local_heads, process_groups, sharded_state_dict_with_head_params


class SubqCoreAttention(MegatronModule):
    """Base of every variant's core attention. Subclasses implement ``attend``.

    ``query_head_stacks``: how many per-head stacks the query carries along its head dimension
    (1; Superlinear's 2: the query heads, then their search queries); the context-parallel
    exchange splits each stack alike so that a CP rank keeps a head with its companions."""

    query_head_stacks: int = 1

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"{type(self).__name__}: attn_mask_type={attn_mask_type} is not "
                             "supported; allowed: causal (every variant is causal attention)")
        if attention_type != "self":
            raise ValueError(f"{type(self).__name__}: attention_type={attention_type!r}; "
                             "allowed: 'self'")
        self.pg_collection = process_groups(pg_collection)
        self.tp_group = self.pg_collection.tp
        self.cp_group = getattr(self.pg_collection, "cp", None)
        self.cp_size = get_pg_size(self.cp_group)
        self.cp_rank = get_pg_rank(self.cp_group) if self.cp_size > 1 else 0
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.num_heads = config.num_attention_heads
        heads_tp = local_heads(config.num_attention_heads, "num_attention_heads",
                               tp_group=self.tp_group)
        self.cp_mode = "none"
        if self.cp_size > 1:
            variant = config.layer_variant(layer_number)
            self.cp_mode = variant.cp_mode(config)
            groups_tp = local_heads(config.num_query_groups or config.num_attention_heads,
                                    "num_query_groups", tp_group=self.tp_group)
            check_context_parallel(variant, self.cp_mode, self.cp_size, heads_tp, groups_tp)
        self.num_heads_tp = heads_tp
        # the heads ``attend`` sees: this TP rank's, split over CP by the all-to-all exchange
        self.cp_head_split = self.cp_size if self.cp_mode == "all_to_all" else 1
        self.num_heads_local = heads_tp // self.cp_head_split
        self.head_dim = config.kv_channels
        self._decode = None  # (inference context, first position): set by bind_decode

    # ---------------------------------------------------------------------------- decoding
    def bind_decode(self, context, start: int) -> None:
        """Make the next ``forward`` a decoding one: its tokens are positions ``[start, start +
        s)`` of the sequences that ``context`` (megatron's static inference context) holds.
        Called by ``SubqSelfAttention._adjust_key_value_for_inference``, the one place the
        context reaches the core."""
        self._decode = (context, start)

    def new_decode_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         max_length: int):
        """An empty per-layer decode cache for sequences of up to ``max_length`` tokens, shaped
        after the first chunk's q ``[B, C, H_local, D]`` and k/v ``[B, C, H_kv_local, D]``
        (variants with ``Variant.decode_cache`` "kv" or "state")."""
        raise NotImplementedError(f"{type(self).__name__}: this variant keeps no decode cache "
                                  "(Variant.decode_cache='none'): decoding is not supported")

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
                      start: int) -> torch.Tensor:
        """``attend`` for the tokens at positions ``[start, start + C)`` of sequences whose
        earlier tokens are in ``cache`` (which this call extends with these): q ``[B, C,
        H_local, D]``, k/v ``[B, C, H_kv_local, D]`` -> ``[B, C, H_local, D]``, rows ``[start,
        start + C)`` of ``attend`` over the whole sequence."""
        raise NotImplementedError(f"{type(self).__name__}: attend_cached is not implemented")

    def _forward_cached(self, query, key, value):
        context, start = self._decode
        self._decode = None
        if self.cp_size > 1:
            raise ValueError(f"{type(self).__name__}: decoding with context_parallel_size="
                             f"{self.cp_size} is not supported; allowed 1")
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
        memory = context.key_value_memory_dict
        if start == 0 or self.layer_number not in memory:
            memory[self.layer_number] = self.new_decode_cache(q, k, v,
                                                              context.max_sequence_length)
        out = self.attend_cached(q, k, v, memory[self.layer_number], start).transpose(0, 1)
        return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, np*hn]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, H_local, D], k/v: [B, T, H_kv_local, D] -> [B, T, H_local, D]."""
        raise NotImplementedError

    def chunk_state(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """State passing (variants with ``Variant.state_passing``): the recurrent state that
        the tokens of ``q/k/v`` ``[B, T, H, D]`` alone leave, as a tuple of tensors, combined
        over chunks by ``states_before`` (a sum unless the variant says otherwise)."""
        raise NotImplementedError

    def states_before(self, chunks: tuple) -> tuple:
        """State passing: from every chunk's own state in sequence order (each tensor of
        ``chunk_state`` stacked: ``[n, ...]``), the state entering each chunk (``[n, ...]``, the
        first empty). Default: additive states, an exclusive prefix sum; a variant whose state
        combines otherwise (a running maximum) overrides it."""
        return tuple(torch.cat([torch.zeros_like(c[:1]), c[:-1].cumsum(0)]) for c in chunks)

    def attend_from_state(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          state: tuple, tokens_before: int) -> torch.Tensor:
        """State passing: ``attend`` of a chunk that follows ``tokens_before`` tokens (a host
        int: the chunk's index times the chunk length) whose summed ``chunk_state`` is
        ``state``."""
        raise NotImplementedError

    def cp_heads(self, param: torch.Tensor) -> torch.Tensor:
        """The rows of a per-head parameter (dim 0: this TP rank's heads) that this CP rank's
        ``attend`` uses; the whole parameter without the all-to-all path. Each CP rank's
        gradient then fills only its rows: the data-parallel reduction over DP x CP (megatron's
        DDP) sums them."""
        if self.cp_head_split == 1:
            return param
        n = self.num_heads_local
        return param[self.cp_rank * n:(self.cp_rank + 1) * n]

    def attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Packed sequences: q [1, T, H_local, D], k/v [1, T, H_kv_local, D], ``cu_seqlens``
        ``[0, end_1, ..., T]`` -> [1, T, H_local, D], each document causal on its own. This
        default runs ``attend`` once per document; ops that take ``cu_seqlens`` override it."""
        bounds = cu_seqlens.tolist()
        outs = [self.attend(q[:, a:b], k[:, a:b], v[:, a:b])
                for a, b in zip(bounds, bounds[1:]) if b > a]
        return torch.cat(outs, dim=1)

    def _forward_packed(self, query, key, value, packed_seq_params):
        name = type(self).__name__
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"{name}: packed_seq_params.qkv_format="
                             f"{packed_seq_params.qkv_format!r}; allowed: 'thd'")
        cu = packed_cu_seqlens(packed_seq_params)
        if cu is None:
            raise ValueError(f"{name}: packed sequences need packed_seq_params.cu_seqlens_q")
        # self-attention: the key boundaries are the query ones (not compared: that would sync)

        def row(x):  # megatron's THD [t, np, hn] (batch squeezed; [t, 1, np, hn] too) -> [1, t, ..]
            return x.squeeze(1).unsqueeze(0) if x.dim() == 4 else x.unsqueeze(0)

        out = self.attend_packed(row(query), row(key), row(value), cu)[0]  # [t, np, hn]
        return out.reshape(out.shape[0], -1)  # [t, np*hn]: megatron adds the batch dim back

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # query: [s, b, np, hn]; key/value: [s, b, ng, hn] (packed: [t, np, hn], see above)
        if attention_bias is not None:
            raise ValueError(f"{type(self).__name__}: attention_bias is not supported")
        if self._decode is not None:
            if packed_seq_params is not None:
                raise ValueError(f"{type(self).__name__}: packed sequences are not supported "
                                 "while decoding; allowed: one batch row per sequence")
            return self._forward_cached(query, key, value)
        if packed_seq_params is not None:
            if self.cp_size > 1:
                raise ValueError(f"{type(self).__name__}: packed sequences (--reset-attention-mask"
                                 ", packed_seq_params) with context parallelism "
                                 f"(--context-parallel-size={self.cp_size}) are not supported; "
                                 "allowed: one of them")
            return self._forward_packed(query, key, value, packed_seq_params)
        if self.cp_mode == "state_passing":
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s/cp, h, d]
            out = self._attend_state_passing(q, k, v).transpose(0, 1)
            return out.reshape(out.shape[0], out.shape[1], -1)
        if self.cp_size > 1:  # [s/cp, b, h, d] zig-zag -> [s, b, h/cp, d] natural order
            query, key, value = qkv_sequence_to_heads(query, key, value, self.cp_group,
                                                      self.query_head_stacks, self.cp_size,
                                                      self.cp_rank)
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
        out = self.attend(q, k, v)  # [b, s, np, hn]
        out = out.transpose(0, 1)  # [s, b, np, hn]
        if self.cp_size > 1:
            out = heads_to_sequence(out, self.cp_group, self.cp_size, self.cp_rank)
        return out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, np*hn]

    def _attend_state_passing(self, q, k, v):
        """This rank's two zig-zag chunks ``[b, s/cp, h, d]``, each attended after the summed
        states of the chunks before it in the sequence: the chunk states are all-gathered over
        the CP group (an autograd all-gather: the gradient of each rank's states comes back to
        it), put in sequence order and combined by ``states_before``."""
        c = q.shape[1] // 2
        halves = [(q[:, :c], k[:, :c], v[:, :c]), (q[:, c:], k[:, c:], v[:, c:])]
        own = [self.chunk_state(*half) for half in halves]
        order = zigzag_chunks(self.cp_size)  # position 2r + half holds chunk order[2r + half]
        natural = [order.index(j) for j in range(2 * self.cp_size)]
        in_order = []
        for parts in zip(*own):  # one state tensor: [2, ...] here -> [cp, 2, ...] gathered
            gathered = _AllGather.apply(torch.stack(parts), self.cp_group)
            gathered = gathered.reshape(2 * self.cp_size, *parts[0].shape)
            in_order.append(torch.stack([gathered[i] for i in natural]))
        before = self.states_before(tuple(in_order))
        outs = []
        for half, (qh, kh, vh) in enumerate(halves):
            j = order[2 * self.cp_rank + half]
            outs.append(self.attend_from_state(qh, kh, vh, tuple(p[j] for p in before),
                                               tokens_before=j * c))
        return torch.cat(outs, dim=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        return sharded_state_dict_with_head_params(self, prefix, sharded_offsets, metadata)


@dataclass
class KVCache:
    """A decode cache of keys and values ``[B, max_length, heads, dim]`` (the ops' layout);
    entries at and past the decoded length are unused. Memory grows with the sequence: one key
    and one value row per token and head."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def like(cls, k: torch.Tensor, v: torch.Tensor, max_length: int) -> "KVCache":
        """Empty buffers for ``max_length`` tokens, batch/heads/dim/dtype/device of k and v
        ``[B, C, heads, dim]``."""
        def empty(x):
            return x.new_empty(x.shape[0], max_length, *x.shape[2:])

        return cls(empty(k), empty(v))

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write k/v ``[B, C, ...]`` at positions ``[start, start + C)``; returns the keys and
        values of positions ``[0, start + C)`` (views)."""
        end = start + k.shape[1]
        if end > self.k.shape[1]:
            raise ValueError(f"KVCache: positions up to {end} exceed the cache's max_length="
                             f"{self.k.shape[1]} (the inference context's max_sequence_length)")
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def copy_state_(dst, src) -> None:
    """Copy a recurrent state's tensors (``tensors()`` or a tuple of tensors) from ``src`` into
    ``dst`` in place, and its ``length`` where it has one: the cache keeps its buffers."""
    get = (lambda s: s.tensors()) if hasattr(dst, "tensors") else tuple
    for a, b in zip(get(dst), get(src)):
        a.copy_(b)
    if hasattr(dst, "length"):
        dst.length = src.length


def packed_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The document boundaries of megatron's THD ``packed_seq_params`` (padded ones if given)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu


# ------------------------------------------------------------------------------------------------
# context parallelism: the all-to-all exchange
# ------------------------------------------------------------------------------------------------
def check_context_parallel(variant, mode: str, cp: int, heads_tp: int, groups_tp: int) -> None:
    """Refuse, before anything is allocated, a CP size the layer's variant cannot run in
    ``mode`` (the config checks the same; modules built with a hand-made ``pg_collection``
    meet it here)."""
    if cp == 1 or mode == "state_passing":
        return
    if mode != "all_to_all":
        raise ValueError(f"context_parallel_size={cp} (--context-parallel-size) is invalid with "
                         f"{variant.name} layers: allowed 1 (context_parallel="
                         f"{variant.context_parallel!r})")
    if heads_tp % cp:
        raise ValueError(f"context_parallel_size={cp} (--context-parallel-size) is invalid: "
                         f"allowed a divisor of the {heads_tp} attention heads per "
                         "tensor-parallel rank")
    if groups_tp % cp and cp % groups_tp:
        raise ValueError(f"context_parallel_size={cp} (--context-parallel-size) is invalid with "
                         f"{groups_tp} key/value heads per tensor-parallel rank: allowed a "
                         "divisor or a multiple of it")


class _AllGather(torch.autograd.Function):
    """``all_gather`` of equal tensors into ``[ranks, ...]``; backward: the gradient summed over
    the ranks (each used every rank's slot), this rank's slot returned (all-reduce: gloo has no
    reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank = get_pg_rank(group)
        parts = [torch.empty_like(x) for _ in range(get_pg_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def zigzag_chunks(cp: int):
    """The chunk each position of a gathered zig-zag sequence holds: rank r's two chunks r and
    2·cp-1-r, ranks in order (megatron's ``get_batch_on_this_cp_rank``)."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


# The exchange of the all-to-all path (issue 24: its layout work used to cost 11-37% of an op).
# Each CP rank holds two zig-zag chunks of c = s/(2·cp) tokens (half 0: chunk r, half 1: chunk
# 2·cp-1-r) for all heads; after the exchange it holds all 2·cp chunks, in natural order, of its
# head slice. Every message is one (peer, half) chunk of one tensor, contiguous on both sides, so
# the zig-zag undo is where the receive lands (no reorder pass), the GQA replication is a
# broadcast in the packing copy, and this rank's own slice never travels: it is copied once,
# straight to its place. Full-tensor passes per tensor (q, k, v, output), each direction:
# 2 - 1/cp (the peers' share: a packing copy + the transfer; the own share: one copy), against 3
# forward before (+1 for replicated key/value heads) and 4·cp backward (autograd's views of the
# chunk reorder: a full-size gradient per chunk, summed). megatron_subq/testing/cp_reference.py
# keeps that path; docs/variants.md has the counts.
def _chunk(cp: int, rank: int, half: int) -> int:
    """The natural-order chunk that CP rank ``rank`` holds as its ``half`` (0, 1)."""
    return rank if half == 0 else 2 * cp - 1 - rank


def _routes(cp: int, rank: int):
    """The messages between this rank and its peers, in the order both sides list them: per
    peer, its halves 0 and 1 (this rank's own chunks never travel: local copies)."""
    return [(peer, half) for peer in range(cp) if peer != rank for half in (0, 1)]


def _slot(peer: int, rank: int, compact: bool) -> int:
    """A peer's index in an exchange buffer: ``compact`` ones hold no slot for this rank."""
    return peer - 1 if compact and peer > rank else peer


def _copy_others(dst: torch.Tensor, src: torch.Tensor, rank: int, compact: str = "") -> None:
    """``dst[p] = src[p]`` along dim 0 (peers) for every peer p but ``rank``: one or two copies.
    ``compact`` ("dst" or "src"): that side holds no slot for ``rank`` (``_slot``)."""
    cp = src.shape[0] + (compact == "src")
    if rank:
        dst[:rank].copy_(src[:rank])
    if rank + 1 < cp:
        d0, s0 = rank + (compact != "dst"), rank + (compact != "src")
        dst[d0:d0 + cp - rank - 1].copy_(src[s0:s0 + cp - rank - 1])


def _natural(x: torch.Tensor, cp: int, peer: int, half) -> torch.Tensor:
    """Of ``x`` ``[2·cp·c, ...]`` in natural order: rank ``peer``'s chunk ``half``, or (half
    None) both its chunks as one strided ``[2, c, ...]`` view."""
    v = x.view(2 * cp, x.shape[0] // (2 * cp), *x.shape[1:])
    if half is None:
        return v[peer:2 * cp - peer:2 * cp - 1 - 2 * peer]
    return v[_chunk(cp, peer, half)]


def _transfer(sends, recvs, group) -> None:
    """Deliver ``sends[i] = (tensor, peer)`` into ``recvs[i'] = (tensor, peer)`` (contiguous
    tensors; peers: ranks of ``group``, never this one; each rank lists its messages to and from
    every peer in one agreed order, ``_routes``): one batch of point-to-point ops (NCCL: one
    grouped call, like its all-to-all; gloo: isend/irecv), waited on. tools/bench_cp_layout.py
    replaces it with local copies (one GPU)."""
    ops = []
    for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
        for t, peer in pairs:
            dst = peer if group is None else dist.get_global_rank(group, peer)
            ops.append(dist.P2POp(op, t, dst, group))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


def _packed_regions(buf: torch.Tensor, heads, c: int, b: int, d: int):
    """Views ``[cp, 2, c, b, n, d]`` of a ``[cp, 2, L]`` exchange buffer, one per tensor of
    ``n`` heads in ``heads``, back to back along L: message (peer, half) of each tensor is
    contiguous."""
    out, off = [], 0
    for n in heads:
        size = c * b * n * d
        out.append(buf[:, :, off:off + size].view(*buf.shape[:2], c, b, n, d))
        off += size
    return out


def _by_peer_kv(x: torch.Tensor, cp: int, c: int) -> torch.Tensor:
    """Key/value heads ``[2c, b, g, d]`` (or their gradient's shape) as ``[cp (peer), 2, c, b,
    g/cp, d]`` for g ≥ cp, else ``[g, 1, 2, c, b, 1, d]`` (peer = head·cp/g + copy: broadcast
    over the cp/g copies)."""
    _, b, g, d = x.shape
    if g >= cp:
        return x.view(2, c, b, cp, g // cp, d).permute(3, 0, 1, 2, 4, 5)
    return x.view(2, c, b, g, 1, d).permute(3, 0, 1, 2, 4, 5).unsqueeze(1)


class _SequenceToHeads(torch.autograd.Function):
    """q ``[2c, b, stacks·h, d]``, k/v ``[2c, b, g, d]`` (this rank's zig-zag chunks, all
    heads) -> ``[2c·cp, b, n, d]`` each (all chunks in natural order, this rank's heads: ``h/cp``
    of each query stack, ``max(g, cp)/cp`` key/value heads, those fewer than cp replicated).

    Forward: one copy per tensor packs the peers' head slices into one ``[cp, 2, L]`` buffer
    (replication: the broadcast of k/v's copy) and this rank's own slice straight into its
    natural-order place; one transfer for q, k and v lands each peer's message at its
    natural-order place of three contiguous outputs (the layout ``attend`` had before).
    Backward, the mirror: the gradients are sent from where they are (contiguous chunks) into one
    buffer, one copy per tensor unpacks it and this rank's own slice (replicated heads: their
    sum, as autograd of ``repeat_interleave`` gives)."""

    @staticmethod
    def forward(ctx, q, k, v, group, cp, rank, stacks):
        s_l, b, hq, d = q.shape
        g, c, h = k.shape[2], s_l // 2, hq // stacks
        heads = (hq // cp, max(g, cp) // cp, max(g, cp) // cp)
        ctx.meta = (group, cp, rank, stacks, q.shape, k.shape, heads)
        compact = g >= cp  # replicated key/value heads fill every slot, this rank's too
        slots = cp - 1 if compact else cp
        buf = q.new_empty(slots, 2, c * b * d * sum(heads))
        regions = _packed_regions(buf, heads, c, b, d)
        outs = [q.new_empty(2 * c * cp, b, n, d) for n in heads]
        q_src = q.view(2, c, b, stacks, cp, h // cp, d).permute(4, 0, 1, 2, 3, 5, 6)
        _copy_others(regions[0].view(slots, 2, c, b, stacks, h // cp, d), q_src, rank,
                     "dst" if compact else "")
        _natural(outs[0], cp, rank, None).view(2, c, b, stacks, h // cp, d).copy_(q_src[rank])
        for region, x, out in zip(regions[1:], (k, v), outs[1:]):
            if compact:
                src = _by_peer_kv(x, cp, c)
                _copy_others(region, src, rank, "dst")
                _natural(out, cp, rank, None).copy_(src[rank])
            else:  # replicas: one broadcasting copy for every peer, this rank's slot included
                region.view(g, cp // g, 2, c, b, 1, d).copy_(_by_peer_kv(x, cp, c))
                _natural(out, cp, rank, None).copy_(region[rank])
        sends, recvs = [], []
        for peer, half in _routes(cp, rank):
            for region, out in zip(regions, outs):
                sends.append((region[_slot(peer, rank, compact), half], peer))
                recvs.append((_natural(out, cp, peer, half), peer))
        _transfer(sends, recvs, group)
        return tuple(outs)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        group, cp, rank, stacks, q_shape, k_shape, heads = ctx.meta
        s_l, b, hq, d = q_shape
        g, c, h = k_shape[2], s_l // 2, hq // stacks
        grads = [x.contiguous() for x in (gq, gk, gv)]  # a no-op for attend's usual [b=1, ...]
        compact = g >= cp
        slots = cp - 1 if compact else cp
        buf = gq.new_empty(slots, 2, c * b * d * sum(heads))
        regions = _packed_regions(buf, heads, c, b, d)
        sends, recvs = [], []
        for peer, half in _routes(cp, rank):
            for region, grad in zip(regions, grads):
                sends.append((_natural(grad, cp, peer, half), peer))
                recvs.append((region[_slot(peer, rank, compact), half], peer))
        _transfer(sends, recvs, group)
        dq = gq.new_empty(q_shape)
        dq_dst = dq.view(2, c, b, stacks, cp, h // cp, d).permute(4, 0, 1, 2, 3, 5, 6)
        _copy_others(dq_dst, regions[0].view(slots, 2, c, b, stacks, h // cp, d), rank,
                     "src" if compact else "")
        dq_dst[rank].copy_(_natural(grads[0], cp, rank, None).view(2, c, b, stacks, h // cp, d))
        dkv = []
        for region, grad in zip(regions[1:], grads[1:]):
            dx = gq.new_empty(k_shape)
            dst = _by_peer_kv(dx, cp, c)
            if compact:
                _copy_others(dst, region, rank, "src")
                dst[rank].copy_(_natural(grad, cp, rank, None))
            else:  # the replicas' gradients summed, this rank's among them
                region[rank].copy_(_natural(grad, cp, rank, None))
                torch.sum(region.view(g, cp // g, 2, c, b, 1, d), dim=1, keepdim=True, out=dst)
            dkv.append(dx)
        return dq, dkv[0], dkv[1], None, None, None, None


class _HeadsToSequence(torch.autograd.Function):
    """``[2c·cp, b, n, d]`` (natural order, this rank's heads) -> ``[2c, b, cp·n, d]`` (this
    rank's zig-zag chunks, all heads; head slice of rank p at ``p·n``). Forward: one transfer
    sends each chunk from where it is into a ``[cp, 2, c, b, n, d]`` buffer, one copy unpacks
    it into the head order (this rank's own chunks straight from the input). Backward, the
    mirror: one packing copy (own chunks straight into the gradient), one transfer into the
    natural-order gradient."""

    @staticmethod
    def forward(ctx, x, group, cp, rank):
        x = x.contiguous()  # a no-op for attend's [b=1, ...] output
        s, b, n, d = x.shape
        c = s // (2 * cp)
        ctx.meta = (group, cp, rank, x.shape)
        buf = x.new_empty(cp - 1, 2, c, b, n, d)  # the peers' messages
        sends, recvs = [], []
        for peer, half in _routes(cp, rank):
            sends.append((_natural(x, cp, peer, half), peer))
            recvs.append((buf[_slot(peer, rank, True), half], peer))
        _transfer(sends, recvs, group)
        out = x.new_empty(2 * c, b, cp * n, d)
        dst = out.view(2, c, b, cp, n, d).permute(3, 0, 1, 2, 4, 5)
        _copy_others(dst, buf, rank, "src")
        dst[rank].copy_(_natural(x, cp, rank, None))
        return out

    @staticmethod
    def backward(ctx, grad):
        group, cp, rank, shape = ctx.meta
        s, b, n, d = shape
        c = s // (2 * cp)
        src = grad.reshape(2, c, b, cp, n, d).permute(3, 0, 1, 2, 4, 5)
        buf = grad.new_empty(cp - 1, 2, c, b, n, d)  # the messages to the peers
        _copy_others(buf, src, rank, "dst")
        dx = grad.new_empty(shape)
        _natural(dx, cp, rank, None).copy_(src[rank])
        sends, recvs = [], []
        for peer, half in _routes(cp, rank):
            sends.append((buf[_slot(peer, rank, True), half], peer))
            recvs.append((_natural(dx, cp, peer, half), peer))
        _transfer(sends, recvs, group)
        return dx, None, None, None


def _cp_size_rank(group, cp, rank):
    """The CP size and this rank's place in ``group`` unless given."""
    cp = get_pg_size(group) if cp is None else cp
    return cp, (get_pg_rank(group) if rank is None else rank)


def qkv_sequence_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                          stacks: int = 1, cp: Optional[int] = None, rank: Optional[int] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[s/cp, b, stacks·h, d]``, k/v ``[s/cp, b, g, d]`` (this rank's zig-zag sequence
    shard, all heads) -> q ``[s, b, stacks·h/cp, d]`` (this rank's slice ``h/cp`` of each stack,
    so a head keeps its companions), k/v ``[s, b, max(g, cp)/cp, d]`` (key/value heads fewer
    than cp replicated, each head's copies on consecutive ranks: rank r gets head r·g/cp, the
    group of its query heads), the whole sequence in natural order; contiguous (what ``attend``
    has always been given: results are bitwise those of three separate exchanges). One
    exchange for the three (``_SequenceToHeads``: a packing copy and the transfer, 2 - 1/cp
    passes per tensor, each way); autograd runs it backwards. ``cp``/``rank`` default to the
    group's (tools/bench_cp_layout.py passes them: it simulates the other ranks)."""
    cp, rank = _cp_size_rank(group, cp, rank)
    return _SequenceToHeads.apply(q, k, v, group, cp, rank, stacks)


def heads_to_sequence(x: torch.Tensor, group, cp: Optional[int] = None,
                      rank: Optional[int] = None) -> torch.Tensor:
    """The inverse for the output: ``[s, b, h/cp, d]`` natural order, this rank's heads ->
    ``[s/cp, b, h, d]`` this rank's zig-zag shard, all heads (contiguous, ready for the output
    projection). The transfer and an unpacking copy, each way, 2 - 1/cp passes
    (``_HeadsToSequence``)."""
    cp, rank = _cp_size_rank(group, cp, rank)
    return _HeadsToSequence.apply(x, group, cp, rank)
