"""Packed sequences (megatron's THD ``packed_seq_params``; the trainer's --reset-attention-mask):
documents packed into one row get exactly the losses they get alone, for every variant that
declares support, at TP=1 and TP=2 + SP; the others refuse with an error naming the supported."""

import pytest

from megatron_subq.variants import packed_sequence_variants
from megatron_subq.testing import run_distributed
from megatron_subq.testing.cases import variant_test_settings
from megatron_subq.testing.packed import packed_vs_separate_losses

PACKED = packed_sequence_variants()


def test_packed_variants_are_declared():
    assert {"standard", "asa", "ppa", "superlinear", "approx", "nonapprox", "sas", "mlp"} <= \
        set(PACKED)


def _check(results, atol=2e-5):
    import torch

    for r in results:
        assert r["packed"].shape == r["separate"].shape
        torch.testing.assert_close(r["packed"], r["separate"], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("variant", PACKED)
def test_packed_documents_do_not_see_each_other(variant):
    # the tiny settings' small windows: PPA's offsets and Superlinear's spans reach beyond them
    kwargs = variant_test_settings(variant)
    _check(run_distributed(packed_vs_separate_losses, 1, tp=1, args=(kwargs,)))


def test_packed_documents_tp2_sequence_parallel():
    kwargs = {**variant_test_settings("asa"), "sequence_parallel": True}
    _check(run_distributed(packed_vs_separate_losses, 2, tp=2, args=(kwargs,)))


def test_packed_sequences_refused_by_other_variants():
    from megatron_subq.variants import VARIANTS

    assert sorted(set(VARIANTS) - set(PACKED)) == ["fixed_seq_qk", "rnd_emb_qk", "static_emb_qk"]
    with pytest.raises(RuntimeError, match="packed sequences .* not supported with the QK-source"):
        run_distributed(packed_vs_separate_losses, 1, tp=1,
                        args=({"attention_variant": "static_emb_qk"},))
