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


# ---- the comparison (tests/test_cp_exchange.py; on GPUs with NCCL too) -------------------------
# (cp, query heads per stack, key/value heads, query stacks, batch)
CASES = [(cp, h, g, stacks, b) for cp in (2, 4)
         for h, g, stacks, b in ((4, 4, 1, 1), (4, 2, 1, 2), (4, 1, 1, 2), (4, 1, 2, 1),
                                 (8, 2, 2, 2))]


def naive_attend(stacks: int):
    """A naive causal softmax attention ``[s, b, h, d]`` (GQA by repetition); with two stacks
    the second query stack's attention is added at half weight."""

    def attend(q, k, v):
        h = q.shape[2] // stacks
        k, v = (x.repeat_interleave(h // x.shape[2], dim=2) for x in (k, v))
        out = 0
        for i in range(stacks):
            qi = q[:, :, i * h:(i + 1) * h]
            scores = torch.einsum("sbhd,tbhd->bhst", qi, k) / qi.shape[-1] ** .5
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            out = out + torch.einsum("bhst,tbhd->sbhd", probs, v) / (i + 1)
        return out
    return attend


def compare_exchanges(device: str = "cpu") -> dict:
    """On every rank of an initialised world of 2 or 4: per case of ``CASES`` whose CP size
    fits (CP=2 over pairs of ranks in a world of four, so group ranks are not global ranks),
    ``[reference, packed]``, each ``[output, grad q, grad k, grad v]`` (on the CPU)."""
    from ..attention import heads_to_sequence, qkv_sequence_to_heads

    world, size = dist.get_rank(), dist.get_world_size()
    groups = {2: dist.group.WORLD}
    if size == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups = {2: pairs[world // 2], 4: dist.group.WORLD}
    out = {}
    for case in CASES:
        cp, h, g, stacks, b = case
        if cp not in groups:
            continue
        group = groups[cp]
        gen = torch.Generator().manual_seed(hash(case) % 1000 + world)
        s_local, d = 6, 8  # 2·cp chunks of 3 tokens over the group
        q, k, v, grad = (torch.randn(s_local, b, n, d, generator=gen).to(device)
                         for n in (stacks * h, g, g, h))
        results = []
        for path in ("reference", "packed"):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            if path == "reference":
                y = reference_exchange(*x, group, naive_attend(stacks), stacks)
            else:
                heads = qkv_sequence_to_heads(*x, group, stacks)
                y = heads_to_sequence(naive_attend(stacks)(*heads), group)
            y.backward(grad)
            results.append([t.detach().cpu() for t in [y] + [t.grad for t in x]])
        out[case] = results
    return out


def _worker(rank, world_size, port, out_dir, backend):
    import os
    import pickle
    import traceback

    torch.set_num_threads(1)
    device = "cpu"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        result = ("ok", compare_exchanges(device))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_comparison(world_size: int, backend: str = "gloo", start_method: str = "fork") -> list:
    """``compare_exchanges`` on a fresh world (gloo: forked from this process, whose modules are
    imported already; NCCL: spawned, one GPU a rank); the per-rank results."""
    import multiprocessing
    import os
    import pickle
    import tempfile

    from ..distributed import free_port

    ctx = multiprocessing.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="subq-cpx-") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited ({p.exitcode}) without a result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results
