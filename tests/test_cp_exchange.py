"""The packed all-to-all exchange of context parallelism (``qkv_sequence_to_heads`` /
``heads_to_sequence`` in megatron_subq/attention.py, issue 24) against the path it replaced
(``megatron_subq.testing.cp_reference``: three ``sequence_to_heads``, the GQA replication,
``heads_to_sequence``): around the same naive ``attend``, every rank's output and the
gradients of its q, k and v are bitwise equal, at CP=2 (two groups of two ranks: group ranks
are not global ranks) and CP=4, with key/value heads split, replicated (fewer than CP) and two
query stacks (Superlinear's search queries), batch 1 and 2. One gloo world of four ranks,
forked from this process (the modules already imported: seconds, not a megatron start-up each);
on 2 or 4 GPUs, NCCL too (marked gpu)."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing.cp_reference import CASES, run_comparison  # noqa: E402


def _check(ranks, cps):
    for rank, r in enumerate(ranks):
        assert sorted(r) == sorted(c for c in CASES if c[0] in cps)
        for case, (ref, got) in r.items():
            for what, a, e in zip(("output", "grad q", "grad k", "grad v"), got, ref):
                assert a.shape == e.shape, (rank, case, what)
                assert torch.equal(a, e), (f"rank {rank}, (cp, h, g, stacks, b)={case}: {what} "
                                           f"differs by {(a - e).abs().max()}")


def test_packed_exchange_equals_reference_bitwise():
    _check(run_comparison(4), (2, 4))


@pytest.mark.gpu
def test_packed_exchange_equals_reference_bitwise_nccl():
    """The same on GPUs through NCCL (its grouped send/recv): a world of four GPUs (CP=2 and
    4), or of two (CP=2)."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    world = 4 if n >= 4 else 2
    _check(run_comparison(world, "nccl", "spawn"), (2, 4) if world == 4 else (2,))


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


@pytest.mark.slow
def test_layout_tool_times_state_passing(tmp_path, capsys):
    """tools/bench_cp_layout.py --state-passing on the CPU: one row per CP size and variant, the
    state passing time against the all-to-all path's (layout + op), and the markdown table."""
    import json

    from tools import bench_cp_layout

    out = tmp_path / "layout.json"
    assert bench_cp_layout.main(["--device", "cpu", "--seq", "64", "--heads", "4", "--head-dim",
                                 "8", "--cp", "2", "4", "--repeats", "1", "--state-passing",
                                 "asa", "approx", "nonapprox", "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert [r["cp"] for r in info["rows"]] == [2, 4]
    rows = info["state_passing_rows"]
    assert [(r["cp"], r["variant"]) for r in rows] == [
        (cp, v) for cp in (2, 4) for v in ("asa", "approx", "nonapprox")]
    for r in rows:
        assert r["state_passing_ms"] > 0 and r["all_to_all_op_ms"] > 0
        assert r["all_to_all_ms"] == pytest.approx(r["layout_ms"] + r["all_to_all_op_ms"],
                                                   abs=2e-3)
        assert r["chunk_tokens"] == 64 // (2 * r["cp"])
    assert "| state passing / all-to-all |" in capsys.readouterr().out


def test_layout_tool_profiles_state_passing(tmp_path, capsys):
    """tools/bench_cp_layout.py --profile on the CPU: the state passing step and the all-to-all
    op each get their top ops by self time, in the log and the row's ``profile``."""
    import json

    from tools import bench_cp_layout

    out = tmp_path / "layout.json"
    assert bench_cp_layout.main(["--device", "cpu", "--seq", "64", "--heads", "4", "--head-dim",
                                 "8", "--cp", "2", "--repeats", "1", "--state-passing", "asa",
                                 "--profile", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["state_passing_rows"]
    for path in ("state_passing", "all_to_all_op"):
        prof = row["profile"][path]
        assert prof["steps"] == 1 and prof["kind"] == "cpu ops"
        assert 0 < len(prof["top"]) <= bench_cp_layout.PROFILE_TOP
        assert prof["top"][0]["ms_per_step"] >= prof["top"][-1]["ms_per_step"] > 0
    assert "profile asa state passing" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--state-passing"):
        bench_cp_layout.main(["--device", "cpu", "--profile"])
