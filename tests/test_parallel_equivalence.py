"""TP=2 (with and without SP) and PP=2 must reproduce TP=1, for every variant.

Every registered variant is a case, with its tiny-model settings from
``megatron_subq.testing.cases.VARIANT_TEST_SETTINGS`` (and its tolerance from
``VARIANT_TEST_TOLERANCES``). Same seed, same data: logits, loss and every parameter's gathered
gradient must match TP=1 within fp32 tolerance.
"""

import pytest
import torch

from megatron_subq.testing import run_distributed
from megatron_subq.testing.cases import (VARIANT_TEST_SETTINGS, VARIANT_TEST_TOLERANCES,
                                         variant_test_settings)
from megatron_subq.testing.equivalence import tiny_gpt_step, tiny_gpt_pipeline_losses

VARIANT_CASES = [(name, variant_test_settings(name)) for name in VARIANT_TEST_SETTINGS]
CASE_TOLERANCES = VARIANT_TEST_TOLERANCES

_TP1_CACHE = {}


def _tp1(name, kwargs):
    if name not in _TP1_CACHE:
        _TP1_CACHE[name] = run_distributed(tiny_gpt_step, 1, tp=1, args=(kwargs,))[0]
    return _TP1_CACHE[name]


def _assert_close(got, ref, what, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("name,kwargs", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_tp2_equals_tp1(name, kwargs, sequence_parallel):
    ref = _tp1(name, kwargs)
    ranks = run_distributed(tiny_gpt_step, 2, tp=2,
                            args=({**kwargs, "sequence_parallel": sequence_parallel},))
    tol = CASE_TOLERANCES.get(name, {})
    for rank, got in enumerate(ranks):
        _assert_close(got["logits"], ref["logits"], f"rank {rank} logits")
        _assert_close(got["loss"], ref["loss"], f"rank {rank} loss")
        assert set(got["grads"]) == set(ref["grads"]), "different parameter sets"
        for pname, g in ref["grads"].items():
            _assert_close(got["grads"][pname], g, f"rank {rank} grad of {pname}", **tol)


@pytest.mark.parametrize("name,kwargs", VARIANT_CASES, ids=[c[0] for c in VARIANT_CASES])
def test_pp2_equals_pp1(name, kwargs):
    ref = run_distributed(tiny_gpt_pipeline_losses, 1, tp=1, pp=1, args=(kwargs,))[0]
    ranks = run_distributed(tiny_gpt_pipeline_losses, 2, tp=1, pp=2, args=(kwargs,))
    last = ranks[-1]
    assert len(last) == len(ref) > 0
    for a, b in zip(last, ref):
        _assert_close(a, b, "pipeline microbatch loss")
