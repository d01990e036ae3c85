"""superlinear: anchors, spans, random context access, the op against its definition, gradients,
bad input, config, the module, checkpoints, training.

TP=2 / SP / PP equivalence of the module is in tests/test_parallel_equivalence.py (VARIANT_CASES).
"""

import math

import pytest
import torch

import megatron_subq as subq
from megatron_subq import ops
from megatron_subq.ops.standard import standard_attention_reference
from megatron_subq.kernels.superlinear.plan import _span_scale_table
from megatron_subq.ops.superlinear import (
    anchor_offsets,
    ceil_power,
    ceil_times,
    superlinear_attention_dense,
    superlinear_attention_reference,
    superlinear_plan,
    superlinear_window,
)
from megatron_subq.testing import run_distributed
from megatron_subq.testing.checkpoint import assert_resharded, reshard_tp2_tp1_tp2

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128)


def _inputs(B=2, T=29, H=4, H_kv=2, D=8, dtype=torch.float64, seed=0, qs_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    q_s = torch.randn(B, T, H, D, generator=g, dtype=dtype) * qs_scale
    k = torch.randn(B, T, H_kv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T, H_kv, D, generator=g, dtype=dtype)
    return q, q_s, k, v


# ------------------------------------------------------------------------------------------
# geometry: anchors, window, spans (exact integer arithmetic)
# ------------------------------------------------------------------------------------------
def test_figure3_anchors_and_span_length():
    """The paper's Figure 3: i=30, p=1/2 -> anchors 30, 27, 22, 15, 6; b=2, f=0 -> length 12."""
    assert ops.superlinear_anchors(30, 0.5, 0) == [30, 27, 22, 15, 6]
    assert superlinear_window(0.5, 0) == 0  # sw_index=0: no window, so no anchor is excluded
    assert ceil_power(30, 0.5) == 6 and ceil_times(2.0, ceil_power(30, 0.5)) == 12
    plan = superlinear_plan(31, 0.5, 0.5, 2.0, 0.0, 0)
    assert (30 - plan.offsets).tolist() == [30, 27, 22, 15, 6]
    assert plan.back[30].item() == 12 and plan.fwd[30].item() == 0
    # every key 0..30 lies in some candidate span [t - 12, t]
    covered = set()
    for t in (30, 27, 22, 15, 6):
        covered.update(range(max(0, t - 12), t + 1))
    assert covered == set(range(31))


def test_window_length_and_exclusion():
    assert superlinear_window(0.5, 32) == 1088  # the paper's runs
    assert superlinear_window(1 / 3, 2) == 26
    cfg = subq.SubqTransformerConfig(**BASE, superlinear_sw_index=5, superlinear_search_power=0.5)
    assert cfg.superlinear_window == superlinear_window(0.5, 5) == 35
    for p, sw in ((0.5, 1), (0.5, 4), (1 / 3, 2), (0.54, 3), (1.0, 7)):
        w = superlinear_window(p, sw)
        for i in (0, 1, w - 1, w, w + 1, 3 * w + 5, 500):
            if i < 0:
                continue
            all_anchors = ops.superlinear_anchors(i, p, 0)
            window = set(range(max(0, i - w + 1), i + 1))
            assert ops.superlinear_anchors(i, p, sw) == [t for t in all_anchors
                                                         if t not in window]


@pytest.mark.parametrize("p,sw", [(0.5, 0), (0.5, 3), (1 / 3, 0), (1 / 3, 2), (0.54, 1),
                                  (2 / 3, 0), (0.25, 1), (1.0, 0), (1.0, 4)])
def test_offset_table_equals_the_literal_anchors(p, sw):
    """The op's fixed stride pattern (i - d) equals superlinear_anchors, query by query."""
    T = 700
    offsets = torch.tensor(anchor_offsets(T, p, sw))
    for i in range(T):
        table = (i - offsets[offsets <= i]).tolist()
        assert table == ops.superlinear_anchors(i, p, sw), i


def test_exact_powers():
    assert ceil_power(1000, 1 / 3) == 10 and ceil_power(1001, 1 / 3) == 11  # float pow: 10.000001
    assert ceil_power(4096, 0.5) == 64 and ceil_power(4097, 0.5) == 65
    assert ceil_power(0, 0.5) == 0 and ceil_power(0, 0.0) == 1 and ceil_power(7, 1.0) == 7
    assert ceil_times(0.1, 30) == 3  # float 0.1 * 30 = 3.0000000000000004 would give 4
    assert ceil_times(2.0, 6) == 12 and ceil_times(0.2, 6) == 2
    for q in (0.0, 0.01, 0.5, 1 / 3, 0.54, 2 / 3, 1.0):
        table = _span_scale_table(3000, q)
        assert list(table) == [ceil_power(i, q) for i in range(3000)], q


# ------------------------------------------------------------------------------------------
# random context access and the config validator
# ------------------------------------------------------------------------------------------
def first_unreachable_query(T, p, p_sp, b, f, sw):
    """The first query i < T with a key j <= i in neither its window nor any candidate span of
    its anchors (None if every key is reachable), computed for all queries at once: each
    interval adds +1 at its start and -1 after its end in a [T, T+1] table, a cumulative sum
    counts the intervals covering every (i, j)."""
    plan = superlinear_plan(T, p, p_sp, b, f, sw)
    i = torch.arange(T)[:, None]
    t = i - plan.offsets[None, :]  # [T, A] candidate anchors
    valid = t >= 0
    lo = (t - plan.back[:, None]).clamp(min=0)
    hi = torch.minimum(t + plan.fwd[:, None], i)
    if plan.window > 0:
        lo = torch.cat([lo, (i - plan.window + 1).clamp(min=0)], 1)
        hi = torch.cat([hi, i], 1)
        valid = torch.cat([valid, torch.ones(T, 1, dtype=torch.bool)], 1)
    counts = torch.zeros(T, T + 1, dtype=torch.int32)
    counts.scatter_add_(1, torch.where(valid, lo, 0), valid.int())
    counts.scatter_add_(1, torch.where(valid, hi + 1, 0), -valid.int())
    uncovered = (counts.cumsum(1)[:, :T] <= 0) & (torch.arange(T)[None, :] <= i)
    bad = uncovered.any(1).nonzero()
    return int(bad[0]) if len(bad) else None


def test_random_context_access_default_knobs():
    """Every key j <= i is reachable for every i <= 4096 under the default knobs (and sw=0)."""
    cfg = subq.SubqTransformerConfig(**BASE, attention_variant="superlinear")
    knobs = dict(p=cfg.superlinear_search_power, p_sp=cfg.superlinear_span_power,
                 b=cfg.superlinear_backward_factor, f=cfg.superlinear_forward_factor)
    assert first_unreachable_query(4097, **knobs, sw=cfg.superlinear_sw_index) is None
    assert first_unreachable_query(4097, **knobs, sw=0) is None


# Knobs at the validator's boundary (tight p_sp = 1 - p, b = 1/p), where floors and ceilings
# matter most; f = 0 and no window are the hardest case (both only add keys).
SEARCH_POWERS = (1.0, 0.5, 1 / 3, 0.25, 0.54, 0.4, 2 / 3, 0.3)


@pytest.mark.parametrize("p", SEARCH_POWERS)
def test_validator_conditions_are_sufficient(p):
    for p_sp in (1 - p, min(1.0, 1 - p + 0.1)):
        for b in (1 / p, 1 / p + 0.5):
            subq.SubqTransformerConfig(**BASE, attention_variant="superlinear",
                                       superlinear_search_power=p, superlinear_span_power=p_sp,
                                       superlinear_backward_factor=b)  # accepted
            assert first_unreachable_query(1025, p, p_sp, b, 0.0, 0) is None, (p, p_sp, b)


@pytest.mark.parametrize("p,p_sp,b,needle", [
    (0.5, 0.5, 1.5, "superlinear_backward_factor"),
    (1 / 3, 2 / 3, 2.0, "superlinear_backward_factor"),
    (0.25, 0.75, 2.5, "superlinear_backward_factor"),
    (0.5, 0.4, 2.0, "superlinear_span_power"),
    (1 / 3, 0.5, 3.0, "superlinear_span_power"),
    (0.54, 0.4, 1 / 0.54, "superlinear_span_power"),
])
def test_validator_rejects_knobs_that_break_random_access(p, p_sp, b, needle):
    """Below either bound (tight setting p_sp = 1 - p for the b bound) some key of some query
    i <= 4096 is unreachable, and the config refuses the knobs unless the user opts out."""
    assert first_unreachable_query(4097, p, p_sp, b, 0.0, 0) is not None
    kwargs = dict(**BASE, attention_variant="superlinear", superlinear_search_power=p,
                  superlinear_span_power=p_sp, superlinear_backward_factor=b)
    with pytest.raises(ValueError, match=needle):
        subq.SubqTransformerConfig(**kwargs)
    subq.SubqTransformerConfig(**kwargs, superlinear_allow_no_random_access=True)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(superlinear_search_power=0.0), "superlinear_search_power"),
    (dict(superlinear_search_power=1.5), "superlinear_search_power"),
    (dict(superlinear_span_power=-0.1), "superlinear_span_power"),
    (dict(superlinear_topk=0), "superlinear_topk"),
    (dict(superlinear_backward_factor=-1.0), "superlinear_backward_factor"),
    (dict(superlinear_forward_factor=-0.5), "superlinear_forward_factor"),
    (dict(superlinear_sw_index=-1), "superlinear_sw_index"),
    (dict(attention_output_gate=True), "attention_output_gate"),
    (dict(softmax_scale=0.1), "softmax_scale"),
])
def test_config_rejects_bad_knobs(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        cfg = subq.SubqTransformerConfig(**BASE, attention_variant="superlinear", **kwargs)
        from megatron_subq.variants.superlinear import SuperlinearCoreAttention

        SuperlinearCoreAttention(cfg, layer_number=1, softmax_scale=cfg.softmax_scale)


# ------------------------------------------------------------------------------------------
# the op against its definition
# ------------------------------------------------------------------------------------------
OP_CASES = [  # T, H, H_kv, knobs, query_chunk
    (1, 2, 1, dict(), 4),
    (29, 4, 2, dict(sw_index=1), 8),
    (37, 4, 1, dict(sw_index=1, forward_factor=0.5, topk=3), 16),
    (50, 2, 2, dict(search_power=1 / 3, span_power=2 / 3, backward_factor=3.0), 7),
    (33, 4, 2, dict(sw_index=2, backward_factor=2.5, forward_factor=1.0, topk=1), 64),
    (40, 2, 1, dict(search_power=1.0, span_power=0.0, backward_factor=1.0, topk=4), 9),
]


@pytest.mark.parametrize("T,H,H_kv,knobs,chunk", OP_CASES)
def test_chunked_reference_equals_dense_form(T, H, H_kv, knobs, chunk):
    """The chunked reference (gathers, slabs) == the O(T^2)-mask form, values and gradients."""
    q, q_s, k, v = _inputs(T=T, H=H, H_kv=H_kv)
    for x in (q, q_s, k, v):
        x.requires_grad_(True)
    out = superlinear_attention_reference(q, q_s, k, v, **knobs, query_chunk=chunk)
    ref = superlinear_attention_dense(q, q_s, k, v, **knobs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), (q, q_s, k, v))
    grads_ref = torch.autograd.grad((ref * probe).sum(), (q, q_s, k, v))
    for name, g, g_ref in zip(("q", "q_s", "k", "v"), grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_dense_form_by_loops():
    """The dense form against variants.md written out one (b, h, i) at a time."""
    T, knobs = 21, dict(sw_index=1, topk=2, backward_factor=2.0, forward_factor=0.5)
    q, q_s, k, v = _inputs(B=1, T=T, H=2, H_kv=1, D=4)
    out = superlinear_attention_dense(q, q_s, k, v, **knobs)
    w = superlinear_window(0.5, 1)
    for h in range(2):
        for i in range(T):
            window = set(range(max(0, i - w + 1), i + 1))
            anchors = ops.superlinear_anchors(i, 0.5, 1)
            scores = {t: float(q_s[0, i, h] @ k[0, t, 0]) for t in anchors}
            kept = sorted(anchors, key=lambda t: -scores[t])[:2]
            if not kept:
                keys = sorted(window)
                p = torch.softmax(torch.stack([q[0, i, h] @ k[0, j, 0] for j in keys]) / 2, 0)
                expect = sum(p[n] * v[0, j, 0] for n, j in enumerate(keys))
            else:
                gate = torch.softmax(torch.tensor([scores[t] for t in kept],
                                                  dtype=torch.float64), 0)
                ell = ceil_power(i, 0.5)
                expect = 0
                for g, t in zip(gate, kept):
                    span = range(max(0, t - 2 * ell), min(i, t + math.ceil(0.5 * ell)) + 1)
                    keys = sorted(set(span) | window)
                    logits = torch.stack([q[0, i, h] @ k[0, j, 0] for j in keys]) / 2  # sqrt(4)
                    p = torch.softmax(logits, 0)
                    expect = expect + g * sum(p[n] * v[0, j, 0] for n, j in enumerate(keys))
            torch.testing.assert_close(out[0, i, h], expect, msg=lambda m: f"i={i} h={h}: {m}")


def test_mixture_of_full_attentions():
    """The identity behind "a mixture of full attentions".

    With topk >= #anchors every candidate anchor t of query i is kept, so
        o_i = sum_{t in Anchors(i)} alpha_{i,t} A_{i,t},  alpha_{i,.} = softmax_t(Q_s(i) . K(t)).
    (a) If every span covers all keys (b*l(i) >= i and f*l(i) >= i), A_{i,t} is the full causal
        attention of query i for every t, and since sum_t alpha_{i,t} = 1, o_i is exactly the
        standard causal attention, whatever Q_s is.
    (b) With f = 0, no window and b*l(i) >= i, the span of t is [0, t], so A_{i,t} = Attn(Q(i);
        keys 0..t), a *prefix* attention, and o_i is the alpha-mixture of the prefix attentions
        of query i. Checked against prefix attentions computed by cumulative sums
        N_t = sum_{j<=t} e^{x_ij} v_j, Z_t = sum_{j<=t} e^{x_ij}, Attn(i; 0..t) = N_t / Z_t.
    """
    T = 24
    q, q_s, k, v = _inputs(B=2, T=T, H=4, H_kv=2)
    full = standard_attention_reference(q, k, v)
    knobs = dict(topk=T, backward_factor=float(T), forward_factor=float(T))
    for sw in (0, 2):
        out = ops.superlinear_attention(q, q_s, k, v, **knobs, sw_index=sw, impl="reference")
        torch.testing.assert_close(out, full, rtol=1e-10, atol=1e-10)

    out = ops.superlinear_attention(q, q_s, k, v, topk=T, backward_factor=float(T),
                                    forward_factor=0.0, sw_index=0, impl="reference")
    kr, vr = ops.repeat_kv(k, 4), ops.repeat_kv(v, 4)
    logits = torch.einsum("bihd,bjhd->bhij", q, kr) / math.sqrt(q.shape[-1])
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))  # [b, h, i, j]
    numer = torch.einsum("bhij,bjhd->bhijd", weights, vr).cumsum(3)  # N_t, prefix over j
    prefix_attn = numer / weights.cumsum(3)[..., None]  # [b, h, i, t, d]
    search = torch.einsum("bihd,bthd->bhit", q_s, kr)
    expect = torch.zeros_like(out)
    for i in range(T):
        anchors = ops.superlinear_anchors(i, 0.5, 0)
        alpha = torch.softmax(search[:, :, i, anchors], dim=-1)  # [b, h, #anchors]
        expect[:, i] = torch.einsum("bha,bhad->bhd", alpha, prefix_attn[:, :, i, anchors])
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)


def test_no_anchor_means_window_attention():
    """A window longer than the sequence leaves no anchor: the output is causal attention."""
    q, q_s, k, v = _inputs(T=30)
    out = ops.superlinear_attention(q, q_s, k, v, sw_index=6, impl="reference")  # w = 48
    torch.testing.assert_close(out, standard_attention_reference(q, k, v), rtol=1e-10,
                               atol=1e-10)


def test_ties_go_to_the_nearest_anchor_and_few_anchors_keep_all():
    """q_s = 0 makes every search score 0: top-1 keeps the nearest anchor outside the window."""
    T, sw = 40, 1  # w = 3; nearest anchor of i is i - 3
    q, q_s, k, v = _inputs(B=1, T=T, H=2, H_kv=2)
    out = ops.superlinear_attention(q, torch.zeros_like(q_s), k, v, topk=1, sw_index=sw,
                                    impl="reference")
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        mask[i, max(0, i - 2):i + 1] = True  # the window
        if i >= 3:
            t = i - 3
            mask[i, max(0, t - 2 * ceil_power(i, 0.5)):t + 1] = True
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.shape[-1])
    expect = torch.einsum("bhij,bjhd->bihd",
                          torch.softmax(logits.masked_fill(~mask, float("-inf")), -1), v)
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)
    # fewer anchors than topk: all are kept, so any topk >= the most anchors gives one answer
    most = len(anchor_offsets(T, 0.5, 0))
    a = ops.superlinear_attention(q, q_s, k, v, topk=most, impl="reference")
    b = ops.superlinear_attention(q, q_s, k, v, topk=most + 7, impl="reference")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gradients_reach_q_s_through_the_gate_only():
    q, q_s, k, v = _inputs(B=1, T=10, H=2, H_kv=1, D=3)
    knobs = dict(topk=2, sw_index=0)
    args = tuple(x.clone().requires_grad_(True) for x in (q, q_s, k, v))
    assert torch.autograd.gradcheck(
        lambda *a: superlinear_attention_reference(*a, **knobs, query_chunk=4), args,
        fast_mode=True)
    out = ops.superlinear_attention(*args, **knobs, impl="reference")
    (g_qs,) = torch.autograd.grad(out.square().sum(), args[1])
    assert g_qs.abs().sum() > 0
    # top-1: the gate is identically 1, so nothing reaches q_s (top-k itself is not differentiable)
    out1 = ops.superlinear_attention(*args, topk=1, sw_index=0, impl="reference")
    (g_qs1,) = torch.autograd.grad(out1.square().sum(), args[1])
    assert torch.count_nonzero(g_qs1) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    q, q_s, k, v = _inputs(T=33, dtype=torch.float32, qs_scale=0.3)
    knobs = dict(sw_index=1, forward_factor=0.5)
    half = ops.superlinear_attention(*(x.to(dtype) for x in (q, q_s, k, v)), **knobs,
                                     impl="reference")
    ref = ops.superlinear_attention(*(x.to(dtype).float() for x in (q, q_s, k, v)), **knobs,
                                    impl="reference")
    assert half.dtype == dtype
    torch.testing.assert_close(half.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("change,needle", [
    (dict(q_s=torch.zeros(2, 9, 2, 8)), "q_s must have the shape"),
    (dict(q_s=torch.zeros(2, 9, 4, 8, dtype=torch.float64)), "q_s must share"),
    (dict(q_s="x"), "q_s must be a torch.Tensor"),
    (dict(k=torch.zeros(2, 9, 3, 8), v=torch.zeros(2, 9, 3, 8)), "multiple"),
    (dict(v=torch.zeros(2, 8, 2, 8)), "share"),
    (dict(search_power=0.0), "search_power"),
    (dict(search_power=1.2), "search_power"),
    (dict(span_power=1.5), "span_power"),
    (dict(topk=0), "topk"),
    (dict(topk=1.5), "topk"),
    (dict(backward_factor=-1.0), "backward_factor"),
    (dict(forward_factor=-0.1), "forward_factor"),
    (dict(sw_index=-2), "sw_index"),
    (dict(sw_index=1.0), "sw_index"),
    (dict(impl="fast"), "impl"),
])
def test_bad_arguments_name_the_argument(change, needle):
    q, q_s, k, v = _inputs(T=9, dtype=torch.float32)
    args = dict(q=q, q_s=q_s, k=k, v=v)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=needle):
        ops.superlinear_attention(**args)


def test_bad_helper_arguments():
    with pytest.raises(ValueError, match="position"):
        ops.superlinear_anchors(-1, 0.5, 0)
    with pytest.raises(ValueError, match="search_power"):
        ops.superlinear_anchors(3, 0.0, 0)
    q, q_s, k, v = _inputs(T=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="query_chunk"):
        superlinear_attention_reference(q, q_s, k, v, query_chunk=0)


def test_core_attention_matches_op():
    """The core attention outside any parallel state: [s, b, h, d] in, the op's output out."""
    from megatron_subq.variants.superlinear import SuperlinearCoreAttention

    cfg = subq.SubqTransformerConfig(**BASE, attention_variant="superlinear",
                                     superlinear_sw_index=1, superlinear_topk=3)
    core = SuperlinearCoreAttention(cfg, layer_number=1)
    s, b = 11, 2
    q, q_s = torch.randn(s, b, 4, 16), torch.randn(s, b, 4, 16)
    k, v = torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)
    out = core(torch.cat([q, q_s], dim=2), k, v, None)  # the search queries after the query heads
    ref = ops.superlinear_attention(q.transpose(0, 1), q_s.transpose(0, 1), k.transpose(0, 1),
                                    v.transpose(0, 1), sw_index=1, topk=3)
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(s, b, 64))
    with pytest.raises(ValueError, match="search_query"):
        core(q, k, v, None)


# ------------------------------------------------------------------------------------------
# the module, checkpoints (TP=2 -> TP=1 -> TP=2) and training, in spawned worlds
# ------------------------------------------------------------------------------------------
SUPERLINEAR = {"attention_variant": "superlinear", "superlinear_sw_index": 1}


def test_dist_checkpoint_reshards_tp2_tp1_tp2(tmp_path):
    """linear_qs (and everything else) is declared with the right sharding."""
    assert_resharded(run_distributed(reshard_tp2_tp1_tp2, 2, tp=2, args=(SUPERLINEAR,
                                                                         str(tmp_path))))


def module_and_training(steps: int) -> dict:
    """(1) SuperlinearSelfAttention == its definition written out (projections, RoPE on q, q_s
    and k, the op, output projection); (2) a tiny superlinear GPT trained with Adam on a fixed
    batch of a learnable sequence: the losses."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.transformer.spec_utils import build_module

    from megatron_subq.slots import get_spec_provider
    from megatron_subq.testing.equivalence import TINY, fit_repeating_batch
    from megatron_subq.variants.superlinear import SuperlinearSelfAttention, attention_spec

    cfg = subq.SubqTransformerConfig(**{**TINY, **SUPERLINEAR, "superlinear_topk": 3})
    attn = build_module(attention_spec(cfg, 1, get_spec_provider(False)), config=cfg,
                        layer_number=1)
    assert isinstance(attn, SuperlinearSelfAttention)
    s, b = 20, 2
    x = torch.randn(s, b, cfg.hidden_size)
    rope = RotaryEmbedding(cfg.kv_channels, rotary_percent=1.0)(s)
    out, _ = attn(x, None, rotary_pos_emb=rope)
    qkv, _ = attn.linear_qkv(x)
    qkv = qkv.view(s, b, 2, 4 * cfg.kv_channels)  # per group: 2 query heads, k, v
    q = qkv[..., :32].reshape(s, b, 4, 16)
    k, v = qkv[..., 32:48], qkv[..., 48:]
    q_s = (x @ attn.linear_qs.weight.t()).view(s, b, 4, 16)
    q, q_s, k = (apply_rotary_pos_emb(t, rope, config=cfg) for t in (q, q_s, k))
    core = ops.superlinear_attention(*(t.transpose(0, 1) for t in (q, q_s, k, v)), sw_index=1,
                                     topk=3)
    expect = core.transpose(0, 1).reshape(s, b, 64) @ attn.linear_proj.weight.t()
    module_error = (out - expect).abs().max()
    out.square().sum().backward()
    qs_grad = attn.linear_qs.weight.grad.abs().sum()

    model = subq.build_gpt_model(subq.SubqTransformerConfig(**{**TINY, **SUPERLINEAR}),
                                 vocab_size=64, max_sequence_length=32)
    losses = fit_repeating_batch(model, steps)
    return dict(module_error=module_error, qs_grad=qs_grad, losses=losses,
                qs_shape=tuple(attn.linear_qs.weight.shape))


def test_module_definition_and_tiny_gpt_trains():
    r = run_distributed(module_and_training, 1, tp=1, args=(40,))[0]
    assert r["qs_shape"] == (64, 64)
    assert r["module_error"] < 1e-5
    assert r["qs_grad"] > 0
    losses = torch.tensor(r["losses"])
    assert torch.isfinite(losses).all()
    assert losses[-1] < 0.6 * losses[0], losses


def test_plans_reach_a_gpu_without_a_blocking_copy(monkeypatch):
    """kernels.superlinear.plan.to_device: a pinned, non-blocking copy to CUDA (a blocking copy of
    pageable memory waits for the stream to drain: each new prefill chunk's plan stalled the host),
    and every tensor of a plan goes through it."""
    from megatron_subq.kernels.superlinear import decode as decode_mod, plan as plan_mod

    calls = []

    class Host:
        def pin_memory(self):
            calls.append("pin")
            return self

        def to(self, device, non_blocking=False):
            calls.append((str(device), non_blocking))
            return "on the device"

    assert plan_mod.to_device(Host(), "cuda:0") == "on the device"
    assert calls == ["pin", ("cuda:0", True)]
    t = torch.arange(3)
    assert plan_mod.to_device(t, None) is t and plan_mod.to_device(t, "cpu").equal(t)

    seen = []
    monkeypatch.setattr(plan_mod, "to_device", lambda host, device: seen.append(device) or host)
    monkeypatch.setattr(decode_mod, "to_device", lambda host, device: seen.append(device) or host)
    plan_mod.superlinear_plan_range(64, 96, device="cuda")
    plan_mod.superlinear_plan(32, device="cuda")
    decode_mod.decode_offsets(1 << 20, 0.5, 0, "cuda")  # a bucket no other test uses: not cached
    assert seen == ["cuda"] * 7  # offsets, back, fwd twice; the decode offset table
