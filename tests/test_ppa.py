"""PPA (power-based partial attention): exact offsets, the attention against its definitions, the
module and the variant (../shared/variants.md, "ppa"; issue 3's conformance list)."""

from fractions import Fraction

import pytest
import torch

from megatron_subq import SubqTransformerConfig, VARIANTS
from megatron_subq.ops import ppa_attention, ppa_offsets, standard_attention
from megatron_subq.kernels.powers import floor_power
from megatron_subq.ops.ppa import (default_chunk_size, ppa_attention_masked,
                                   ppa_attention_reference, ppa_far_offsets, ppa_mask)
from megatron_subq.testing import run_distributed
from megatron_subq.testing.equivalence import TINY, fit_repeating_batch

MAX_OFFSET = 10**6


def _qkv(B, T, H, H_kv, D, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, h, D, generator=g, dtype=dtype).requires_grad_(requires_grad)
                 for h in (H, H_kv, H_kv))


# ---------------------------------------------------------------------------------------------
# offsets: exact integer checks, written independently of powers.floor_power
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 9))
def test_offsets_for_p_one_over_n_are_the_nth_powers(n):
    expected, r = [], 1
    while r**n <= MAX_OFFSET:
        expected.append(r**n)
        r += 1
    assert ppa_offsets(1 / n, MAX_OFFSET) == expected


def _largest_r(a: int, b: int, m: int) -> int:
    """The largest r with r^b <= m^a, by bisection on integers."""
    lo, hi = 0, m + 1  # r^b <= m^a holds at lo, fails at hi (a <= b)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mid**b <= m**a else (lo, mid)
    return lo


@pytest.mark.parametrize("k", range(0, 9))
def test_offsets_for_p_k_over_8_match_integer_boundaries(k):
    # p = k/8 (unreduced on purpose): floor(j^p) >= r  <=>  j^k >= r^8. floor(j^p) climbs by at
    # most one per step, so S_p has one offset per r = 1..floor(M^p): the first j with j^k >= r^8.
    offsets = ppa_offsets(k / 8, MAX_OFFSET)
    if k == 0:
        assert offsets == []
        return
    assert len(offsets) == _largest_r(k, 8, MAX_OFFSET)
    bad = [(r, j) for r, j in enumerate(offsets, start=1)
           if not (j**k >= r**8 > (j - 1) ** k)]
    assert not bad, f"offsets that are not the first j reaching floor(j^p) = r: {bad[:5]}"
    assert offsets[-1] <= MAX_OFFSET


@pytest.mark.parametrize("power", [0.3, 0.333, 1 / 3, 2 / 3, 0.7, 0.9, Fraction(5, 7)])
def test_offsets_follow_the_definition(power):
    """S_p = {j >= 1 : floor(j^p) - floor((j-1)^p) = 1}, straight from the definition."""
    M = 3000
    expected = [j for j in range(1, M + 1)
                if floor_power(j, power) - floor_power(j - 1, power) == 1]
    assert ppa_offsets(power, M) == expected


@pytest.mark.parametrize("power,a,b,m", [(0.999, 999, 1000, 5000), (0.333, 333, 1000, 10**5),
                                         (0.3, 3, 10, 10**5)])
def test_offsets_for_large_denominators_match_integer_boundaries(power, a, b, m):
    offsets = ppa_offsets(power, m)
    assert len(offsets) == _largest_r(a, b, m)
    assert all(j**a >= r**b > (j - 1) ** a for r, j in enumerate(offsets, start=1))


def test_offsets_paper_examples():
    half, third = ppa_offsets(0.5, 100), ppa_offsets(1 / 3, 100)
    assert 9 in half and 8 not in half and 8 in third
    assert half[:6] == [1, 4, 9, 16, 25, 36]
    assert third == [1, 8, 27, 64]
    # 0.333 is the rational 333/1000, not 1/3: 8^0.333 < 2, so 8 is not an offset there
    assert 8 not in ppa_offsets(0.333, 100) and 9 in ppa_offsets(0.333, 100)
    assert ppa_offsets(1, 6) == [1, 2, 3, 4, 5, 6]
    assert ppa_offsets(0, 100) == [] and ppa_offsets(0.5, 0) == []


def test_mask_rows():
    mask = ppa_mask(12, 0.5, 1)
    assert torch.nonzero(mask[11]).flatten().tolist() == [2, 7, 10, 11]  # offsets 9, 4, 1, 0
    assert torch.nonzero(mask[3]).flatten().tolist() == [2, 3]  # offset 4 would be before 0
    assert not mask.triu(1).any()


# ---------------------------------------------------------------------------------------------
# the attention against its definitions
# ---------------------------------------------------------------------------------------------
def _sliding_window_attention(q, k, v, window):
    """Softmax over the w+1 most recent keys, built without any PPA code."""
    B, T, H, D = q.shape
    k, v = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / D**0.5
    ones = torch.ones(T, T, dtype=torch.bool)
    keep = ones.tril() & ones.triu(-window)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


FORMS = {
    "masked": ppa_attention_masked,
    "chunked": lambda q, k, v, p, w: ppa_attention_reference(q, k, v, p, w, chunk_size=5),
    "op": ppa_attention,
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window", [0, 5])
def test_power_one_is_full_causal_attention(form, window):
    q, k, v = _qkv(2, 23, 4, 2, 8, dtype=torch.float32)
    expected = standard_attention(q, k, v, impl="reference")
    torch.testing.assert_close(FORMS[form](q, k, v, 1.0, window), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window", [0, 1, 4])
def test_power_zero_is_a_sliding_window(form, window):
    q, k, v = _qkv(2, 23, 4, 1, 8, dtype=torch.float32, seed=1)
    expected = _sliding_window_attention(q, k, v, window)
    torch.testing.assert_close(FORMS[form](q, k, v, 0.0, window), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 7, 33, 50])
@pytest.mark.parametrize("power,window", [(0.25, 0), (1 / 3, 2), (0.5, 0), (0.5, 3), (0.75, 1)])
def test_chunked_reference_equals_the_masked_form(T, power, window):
    q, k, v = _qkv(2, T, 6, 2, 4, seed=T)
    expected = ppa_attention_masked(q, k, v, power, window)
    for chunk in (1, 4, 16, None):
        got = ppa_attention_reference(q, k, v, power, window, chunk_size=chunk)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"chunk_size={chunk}: {m}")


def test_gradients_flow_and_match_the_masked_form():
    q, k, v = _qkv(1, 41, 4, 2, 8, seed=3, requires_grad=True)
    grad_out = torch.randn(1, 41, 4, 8, dtype=torch.float64)
    ref = torch.autograd.grad((ppa_attention_masked(q, k, v, 0.5, 2) * grad_out).sum(), (q, k, v))
    got = torch.autograd.grad(
        (ppa_attention_reference(q, k, v, 0.5, 2, chunk_size=8) * grad_out).sum(), (q, k, v))
    for name, g, r in zip("qkv", got, ref):
        assert g.abs().sum() > 0, f"no gradient reaches {name}"
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_half_precision_inputs_keep_their_dtype():
    q, k, v = _qkv(1, 20, 2, 2, 8, dtype=torch.bfloat16)
    out = ppa_attention(q, k, v, 0.5, 2)
    assert out.dtype == torch.bfloat16
    expected = ppa_attention_masked(q.double(), k.double(), v.double(), 0.5, 2)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_long_sequence_rows_match_a_per_query_gather():
    """T = 8192 through the chunked reference; a few rows recomputed from their key sets."""
    T, w, p = 8192, 16, 0.5
    q, k, v = _qkv(1, T, 2, 1, 4, dtype=torch.float32, seed=4)
    far = ppa_far_offsets(p, w, T)
    assert far.numel() == 90 - 4  # sqrt(8191) -> 90 squares, 4 of them (1, 4, 9, 16) <= w
    assert default_chunk_size(T, w, far.numel()) < T  # chunked, never one T x T block
    out = ppa_attention(q, k, v, p, w)
    for i in (0, 5, 100, 4097, T - 1):
        keys = sorted({i - d for d in range(w + 1)} | {i - s for s in ppa_offsets(p, i)})
        keys = torch.tensor([j for j in keys if j >= 0])
        scores = torch.einsum("hd,jd->hj", q[0, i], k[0, keys, 0]) / 2.0
        expected = scores.softmax(-1) @ v[0, keys, 0]
        torch.testing.assert_close(out[0, i], expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("power", [-0.1, 1.5, "0.5", True, None, 0.1234])
def test_bad_power(power):
    q, k, v = _qkv(1, 4, 2, 2, 4)
    with pytest.raises(ValueError, match="power"):
        ppa_attention(q, k, v, power, 2)
    with pytest.raises(ValueError, match="power"):
        ppa_offsets(power, 10)


@pytest.mark.parametrize("window", [-1, 2.5, True, None])
def test_bad_window(window):
    q, k, v = _qkv(1, 4, 2, 2, 4)
    with pytest.raises(ValueError, match="window"):
        ppa_attention(q, k, v, 0.5, window)


def test_bad_tensors_and_impl():
    q, k, v = _qkv(1, 4, 4, 2, 4)
    with pytest.raises(ValueError, match="q must have shape"):
        ppa_attention(q[0], k, v, 0.5, 2)
    with pytest.raises(ValueError, match="multiple of the key/value"):
        ppa_attention(q, k[:, :, :1].expand(1, 4, 3, 4), v[:, :, :1].expand(1, 4, 3, 4), 0.5, 2)
    with pytest.raises(ValueError, match="share a dtype"):
        ppa_attention(q, k.float(), v, 0.5, 2)
    with pytest.raises(ValueError, match="impl"):
        ppa_attention(q, k, v, 0.5, 2, impl="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        ppa_attention_reference(q, k, v, 0.5, 2, chunk_size=0)
    with pytest.raises(ValueError, match="max_offset"):
        ppa_offsets(0.5, -1)


# ---------------------------------------------------------------------------------------------
# config, module, variant
# ---------------------------------------------------------------------------------------------
def _config(**kw):
    return SubqTransformerConfig(**{**TINY, "attention_variant": "ppa", **kw})


@pytest.mark.parametrize("field,value", [("ppa_power", 1.5), ("ppa_power", -0.5),
                                         ("ppa_power", 0.1234), ("ppa_window", -1),
                                         ("ppa_window", 2.0)])
def test_config_rejects_bad_knobs(field, value):
    with pytest.raises(ValueError, match=field):
        _config(**{field: value})


def test_config_accepts_rational_powers():
    assert _config(ppa_power=1 / 3, ppa_window=0).ppa_power == 1 / 3
    assert _config(ppa_power=0.875).ppa_window == 64


def test_core_attention_module_matches_the_op():
    from megatron_subq.slots import get_spec_provider
    from megatron_subq.variants.ppa import PPACoreAttention

    config = _config(ppa_power=0.5, ppa_window=1)
    spec = VARIANTS["ppa"].attention_spec(config, 1, get_spec_provider(use_te=False))
    assert spec.submodules.core_attention is PPACoreAttention
    core = PPACoreAttention(config, layer_number=1)
    assert not list(core.parameters())
    s, b, h, g, d = 19, 2, 4, 2, 16
    q, k, v = _qkv(s, b, h, g, d, dtype=torch.float32, seed=5)  # megatron's [s, b, h, d]
    out = core(q, k, v, attention_mask=None)
    assert out.shape == (s, b, h * d)
    expected = ppa_attention_masked(*(x.transpose(0, 1) for x in (q, k, v)), 0.5, 1)
    torch.testing.assert_close(out, expected.transpose(0, 1).reshape(s, b, h * d),
                               rtol=1e-5, atol=1e-6)


def train_tiny_ppa_gpt(steps: int) -> list:
    """Rank function: a 2-layer PPA GPT learns a fixed batch with Adam; returns the losses."""
    from megatron_subq.specs import build_gpt_model

    seq, vocab = 32, 64
    config = SubqTransformerConfig(**{**TINY, "attention_variant": "ppa", "ppa_power": 0.5,
                                      "ppa_window": 3})
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=seq)
    return fit_repeating_batch(model, steps, vocab=vocab, seq=seq)


def test_tiny_ppa_gpt_trains():
    losses = run_distributed(train_tiny_ppa_gpt, 1, tp=1, args=(20,))[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"
