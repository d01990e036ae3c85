"""The packed all-to-all exchange of context parallelism (``qkv_sequence_to_heads`` /
``heads_to_sequence`` in megatron_subq/attention.py, issue 24) against the path it replaced
(``megatron_subq.testing.cp_reference``: three ``sequence_to_heads``, the GQA replication,
``heads_to_sequence``): around the same naive ``attend``, every rank's output and the
gradients of its q, k and v are bitwise equal, at CP=2 (two groups of two ranks: group ranks
are not global ranks) and CP=4, with key/value heads split, replicated (fewer than CP) and two
query stacks (Superlinear's search queries), batch 1 and 2. One gloo world of four ranks,
forked from this process (the modules already imported: seconds, not a megatron start-up each).
"""

import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.attention import heads_to_sequence, qkv_sequence_to_heads  # noqa: E402
from megatron_subq.distributed import free_port  # noqa: E402
from megatron_subq.testing.cp_reference import reference_exchange  # noqa: E402

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


def _worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        result = ("ok", _compare())
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _run_forked(world_size):
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="subq-cpx-") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, out_dir))
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
            assert os.path.exists(path), f"rank {r} exited ({p.exitcode}) without a result"
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            assert status == "ok", f"rank {r} failed:\n{value}"
            results.append(value)
        return results


def test_packed_exchange_equals_reference_bitwise():
    ranks = _run_forked(4)
    for rank, r in enumerate(ranks):
        assert len(r) == len(CASES)
        for case, (ref, got) in r.items():
            for what, a, e in zip(("output", "grad q", "grad k", "grad v"), got, ref):
                assert a.shape == e.shape, (rank, case, what)
                assert torch.equal(a, e), (f"rank {rank}, (cp, h, g, stacks, b)={case}: {what} "
                                           f"differs by {(a - e).abs().max()}")


def test_layout_passes_and_kernels(tmp_path, capsys):
    """tools/bench_cp_layout.py --device cpu (one process, the exchange simulated): the packed
    path writes 2 - 1/cp full passes per tensor each way, in 10 kernels (rank 0), against the
    reference's 3 forward and 4·cp backward (docs/variants.md's table)."""
    import json

    from tools import bench_cp_layout

    out = tmp_path / "layout.json"
    assert bench_cp_layout.main(["--device", "cpu", "--seq", "64", "--heads", "8", "--head-dim",
                                 "8", "--cp", "2", "4", "--repeats", "1", "--json",
                                 str(out)]) == 0
    rows = {r["cp"]: r["layout"] for r in json.loads(out.read_text())["rows"]}
    for cp, layout in rows.items():
        packed, ref = layout["packed"], layout["reference"]
        assert packed["passes_fwd"] == packed["passes_bwd"] == 2 - 1 / cp
        assert packed["kernels_fwd"] == packed["kernels_bwd"] == 10
        assert (ref["passes_fwd"], ref["passes_bwd"]) == (3, 4 * cp)
        assert (ref["kernels_fwd"], ref["kernels_bwd"]) == (12, 16 * cp)
    assert "| 2 |" in capsys.readouterr().out
