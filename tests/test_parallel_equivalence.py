"""TP=2 (with and without SP) and PP=2 must reproduce TP=1, for every variant.

Every registered variant is a case, with its tiny-model settings from
``megatron_subq.testing.cases.VARIANT_TEST_SETTINGS`` (and its tolerance from
``VARIANT_TEST_TOLERANCES``). Same seed, same data: logits, loss and every parameter's gathered
gradient must match TP=1 within fp32 tolerance. Two process launches serve every case: one
world of one computes the references (TP=1, PP=1), one world of two every parallel layout
(``testing.equivalence.every_case_every_layout``); each case's tests then compare.
"""

import pytest
import torch

from megatron_subq.testing import run_distributed
from megatron_subq.testing.cases import (VARIANT_TEST_SETTINGS, VARIANT_TEST_TOLERANCES,
                                         variant_test_settings)
from megatron_subq.testing.equivalence import every_case_every_layout

VARIANT_CASES = [(name, variant_test_settings(name)) for name in VARIANT_TEST_SETTINGS]
CASE_TOLERANCES = VARIANT_TEST_TOLERANCES

@pytest.fixture(scope="module")
def results():
    """{case: {layout: result}}: the references in a world of one, the rest in a world of two."""
    ref = run_distributed(every_case_every_layout, 1, args=(VARIANT_CASES, ["tp1", "pp1"]))[0]
    ranks = run_distributed(every_case_every_layout, 2,
                            args=(VARIANT_CASES, ["tp2", "tp2-sp", "pp2"]))
    return {"ref": ref, "ranks": ranks}


def _get(result, what):
    if isinstance(result, tuple) and result and result[0] == "error":
        pytest.fail(f"{what} failed:\n{result[1]}")
    return result


def _assert_close(got, ref, what, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("name,kwargs", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_tp2_equals_tp1(results, name, kwargs, sequence_parallel):
    ref = _get(results["ref"][name]["tp1"], f"{name} at TP=1")
    layout = "tp2-sp" if sequence_parallel else "tp2"
    ranks = [_get(r[name][layout], f"{name} at {layout}, rank {i}")
             for i, r in enumerate(results["ranks"])]
    tol = CASE_TOLERANCES.get(name, {})
    for rank, got in enumerate(ranks):
        _assert_close(got["logits"], ref["logits"], f"rank {rank} logits")
        _assert_close(got["loss"], ref["loss"], f"rank {rank} loss")
        assert set(got["grads"]) == set(ref["grads"]), "different parameter sets"
        for pname, g in ref["grads"].items():
            _assert_close(got["grads"][pname], g, f"rank {rank} grad of {pname}", **tol)


@pytest.mark.parametrize("name,kwargs", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_pp2_equals_pp1(results, name, kwargs):
    ref = _get(results["ref"][name]["pp1"], f"{name} at PP=1")
    last = _get(results["ranks"][-1][name]["pp2"], f"{name} at PP=2")
    assert len(last) == len(ref) > 0
    for a, b in zip(last, ref):
        _assert_close(a, b, "pipeline microbatch loss")
