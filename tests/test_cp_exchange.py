"""The packed all-to-all exchange of context parallelism (``qkv_sequence_to_heads`` /
``heads_to_sequence`` in megatron_subq/attention.py, issue 24) against the path it replaced
(``megatron_subq.testing.cp_reference``: three ``sequence_to_heads``, the GQA replication,
``heads_to_sequence``): around the same naive ``attend``, every rank's output and the
gradients of its q, k and v are bitwise equal, at CP=2 (two groups of two ranks: group ranks
are not global ranks) and CP=4, with key/value heads split, replicated (fewer than CP) and two
query stacks (Superlinear's search queries), batch 1 and 2. One gloo launch of four ranks."""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing import run_distributed  # noqa: E402

# (cp, query heads per stack, key/value heads, query stacks, batch)
CASES = [(cp, h, g, stacks, b) for cp in (2, 4)
         for h, g, stacks, b in ((4, 4, 1, 1), (4, 2, 1, 2), (4, 1, 1, 2), (4, 1, 2, 1),
                                 (8, 2, 2, 2))]


def _attend(stacks):
    """A naive causal softmax attention [s, b, h, d] (GQA by repetition); with two stacks the
    second query stack's attention is added at half weight."""

    def attend(q, k, v):
        h = q.shape[2] // stacks
        k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
        out = 0
        for i in range(stacks):
            qi = q[:, :, i * h:(i + 1) * h]
            scores = torch.einsum("sbhd,tbhd->bhst", qi, k) / qi.shape[-1] ** .5
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            out = out + torch.einsum("bhst,tbhd->sbhd", probs, v) / (i + 1)
        return out
    return attend


def _compare():
    import torch.distributed as dist

    from megatron_subq.attention import heads_to_sequence, qkv_sequence_to_heads
    from megatron_subq.testing.cp_reference import reference_exchange

    world = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {2: pairs[world // 2], 4: dist.group.WORLD}
    out = {}
    for case in CASES:
        cp, h, g, stacks, b = case
        group = groups[cp]
        gen = torch.Generator().manual_seed(hash(case) % 1000 + world)
        s_local, d = 6, 8  # 2·cp chunks of 3 tokens over the group
        q, k, v = (torch.randn(s_local, b, n, d, generator=gen)
                   for n in (stacks * h, g, g))
        grad = torch.randn(s_local, b, h, d, generator=gen)
        results = []
        for path in ("reference", "packed"):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            if path == "reference":
                y = reference_exchange(*x, group, _attend(stacks), stacks)
            else:
                heads = qkv_sequence_to_heads(*x, group, stacks)
                y = heads_to_sequence(_attend(stacks)(*heads), group)
            y.backward(grad)
            results.append([y.detach()] + [t.grad for t in x])
        out[case] = results
    return out


def test_packed_exchange_equals_reference_bitwise():
    ranks = run_distributed(_compare, 4, backend="gloo")
    for rank, r in enumerate(ranks):
        for case, (ref, got) in r.items():
            for what, a, e in zip(("output", "grad q", "grad k", "grad v"), got, ref):
                assert a.shape == e.shape, (rank, case, what)
                assert torch.equal(a, e), (f"rank {rank}, (cp, h, g, stacks, b)={case}: {what} "
                                           f"differs by {(a - e).abs().max()}")
