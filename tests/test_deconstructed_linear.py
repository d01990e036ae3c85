"""The deconstructing-attention variants mlp, approx, nonapprox: ops, decode states, modules.

Ops: every form (O(L^2) definition, chunked reference, prefill + token-by-token decode) against
the others and against a loop transcribed from the paper's equations; approx's near-zero
denominators; nonapprox at large |s|; Table 8's cache sizes. Models (one spawned gloo process
plus one TP=2 run): mlp's parameter match, 2-layer hybrids that learn, the skip ablation, RoPE
ignored by nonapprox, approx TP=2+SP = TP=1 in float64.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_subq import ops
from megatron_subq.ops.approx import (
    approx_attention_chunked,
    approx_attention_quadratic,
    safe_denominator,
)
from megatron_subq.ops.nonapprox import (
    nonapprox_attention_chunked,
    nonapprox_attention_quadratic,
    token_scores,
)
from megatron_subq.testing import run_distributed
from megatron_subq.testing.equivalence import fit_repeating_batch, repeating_batch


def _qkv(B, T, H, H_kv, D, dtype=torch.float64, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=dtype) for h in (H, H_kv, H_kv))
    if positive:  # every approx denominator > 0 and far from 0: well conditioned in fp32
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return q, k, v


# ---------------------------------------------------------------------------------------------
# The equations, transcribed position by position (independent of the ops' vectorised code)
# ---------------------------------------------------------------------------------------------
def _approx_by_the_paper(q, k, v, eps=1e-6):
    """Eq. 14-17 for one head at a time, loops over i; q, k pre-scaled by d_h^{-1/4}."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                qi = q[b, i, h].double() * D ** -0.25
                ks = k[b, : i + 1, h // G].double() * D ** -0.25
                vs = v[b, : i + 1, h // G].double()
                o0 = vs.sum(0) / (i + 1)
                num1, den1 = qi @ (ks.T @ vs), qi @ ks.sum(0)
                q2, k2 = qi**2 / math.sqrt(2), ks**2 / math.sqrt(2)
                num2, den2 = q2 @ (k2.T @ vs), q2 @ k2.sum(0)
                guard = lambda d: d if abs(d) >= eps else (eps if d >= 0 else -eps)  # noqa: E731
                out[b, i, h] = o0 + num1 / guard(den1.item()) + num2 / guard(den2.item())
    return out


def _nonapprox_by_the_paper(q, k, v):
    """Eq. 7-8/18 for one head at a time, loops over i (fp64, small |s| only)."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = [(F.silu(q[b, j, h].double()) * k[b, j, h // G].double()).sum() / math.sqrt(D)
                 for j in range(T)]
            for i in range(T):
                w = torch.stack([torch.exp(s[j]) for j in range(i + 1)])
                out[b, i, h] = (w[:, None] * v[b, : i + 1, h // G].double()).sum(0) / w.sum()
    return out


def test_approx_matches_the_equations():
    q, k, v = _qkv(2, 7, 4, 2, 8, positive=True, seed=1)
    torch.testing.assert_close(approx_attention_quadratic(q, k, v), _approx_by_the_paper(q, k, v))
    torch.testing.assert_close(ops.approx_attention(q, k, v), _approx_by_the_paper(q, k, v))


def test_nonapprox_matches_the_equations():
    q, k, v = _qkv(2, 7, 4, 2, 8, seed=2)
    torch.testing.assert_close(nonapprox_attention_quadratic(q, k, v),
                               _nonapprox_by_the_paper(q, k, v))
    torch.testing.assert_close(ops.nonapprox_attention(q, k, v), _nonapprox_by_the_paper(q, k, v))


# ---------------------------------------------------------------------------------------------
# Chunked (linear-time) form = O(L^2) definition, values and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 16), (40, 64), (33, 8)])
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (6, 1)])
def test_chunked_equals_quadratic(T, chunk, H, H_kv):
    q, k, v = _qkv(2, T, H, H_kv, 8, seed=T)  # signed: o1 denominators of both signs
    torch.testing.assert_close(approx_attention_chunked(q, k, v, chunk_size=chunk)[0],
                               approx_attention_quadratic(q, k, v), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(nonapprox_attention_chunked(q, k, v, chunk_size=chunk)[0],
                               nonapprox_attention_quadratic(q, k, v), rtol=1e-12, atol=1e-12)


def test_chunked_equals_quadratic_fp32_and_dtype():
    q, k, v = _qkv(2, 50, 4, 2, 16, dtype=torch.float32, positive=True, seed=3)
    for fast, slow in ((ops.approx_attention, approx_attention_quadratic),
                       (ops.nonapprox_attention, nonapprox_attention_quadratic)):
        ref = slow(q.double(), k.double(), v.double()).float()
        out = fast(q, k, v)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        half = fast(q.bfloat16(), k.bfloat16(), v.bfloat16())
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), ref, rtol=5e-2, atol=5e-2)


def test_chunked_gradients_equal_quadratic():
    q, k, v = _qkv(1, 11, 2, 1, 4, positive=True, seed=4)
    for fast, slow in ((lambda *a: approx_attention_chunked(*a, chunk_size=4)[0],
                        approx_attention_quadratic),
                       (lambda *a: nonapprox_attention_chunked(*a, chunk_size=4)[0],
                        nonapprox_attention_quadratic)):
        w = torch.randn(1, 11, 2, 4, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(5))
        grads = []
        for fn in (fast, slow):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            (fn(*leaves) * w).sum().backward()
            grads.append([t.grad for t in leaves])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    small = [t[:, :6, :, :3].clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *a: approx_attention_chunked(*a, chunk_size=4)[0],
                                    small)
    assert torch.autograd.gradcheck(lambda *a: nonapprox_attention_chunked(*a, chunk_size=4)[0],
                                    small)


# ---------------------------------------------------------------------------------------------
# approx: denominators at and near zero
# ---------------------------------------------------------------------------------------------
def test_safe_denominator_rule():
    den = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 1e-6, -2e-6, 3.0, -3.0], dtype=torch.float64)
    got = safe_denominator(den, 1e-6)
    torch.testing.assert_close(got, torch.tensor([1e-6, 1e-6, 1e-6, -1e-6, 1e-6, -2e-6, 3.0, -3.0],
                                                 dtype=torch.float64))


def test_approx_zero_query_is_the_running_mean():
    # q = 0: o1 and o2 are 0/0; the guard makes them 0/eps = 0, leaving o0 (running mean of v)
    _, k, v = _qkv(1, 9, 2, 2, 4, seed=6)
    q = torch.zeros(1, 9, 2, 4, dtype=torch.float64, requires_grad=True)
    out = ops.approx_attention(q, k, v)
    mean = v.cumsum(1) / torch.arange(1, 10, dtype=torch.float64).view(1, 9, 1, 1)
    torch.testing.assert_close(out, mean, rtol=0, atol=1e-15)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_approx_exactly_zero_denominator_is_finite_and_consistent(dtype):
    # k_1 = -k_0 makes sum_{j<=1} k~_j = 0 exactly: o1's denominator at i = 1 is exactly 0 (and
    # o1's numerator q~.k~_0 (v_0 - v_1) is not); the guard divides by +eps, in every form
    eps = 1e-6
    q, k, v = _qkv(1, 4, 1, 1, 4, dtype=dtype, seed=7)
    k = torch.cat([k[:, :1], -k[:, :1], k[:, 2:]], 1)
    forms = {"quadratic": approx_attention_quadratic(q, k, v, eps=eps),
             "chunked": approx_attention_chunked(q, k, v, eps=eps, chunk_size=2)[0]}
    state = ops.approx_empty_state(1, 1, 4, dtype=torch.float64)
    forms["decode"] = torch.stack([ops.approx_decode_step(q[:, t], k[:, t], v[:, t], state,
                                                          eps=eps) for t in range(4)], 1)
    expected = _approx_by_the_paper(q, k, v, eps=eps)
    assert expected[0, 1].abs().max() > 1e3  # the guarded division really happened
    for name, out in forms.items():
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=name)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    approx_attention_chunked(*leaves, eps=eps)[0].sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_approx_tiny_denominator_is_bounded_by_the_guard():
    # q~ . sum k~ = 1e-9 (below eps): |o1| <= |numerator| / eps instead of |numerator| / 1e-9
    D = 2
    q = torch.tensor([[[[1.0, 1.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.5, -0.5 + 1e-9 * math.sqrt(D)]]]], dtype=torch.float64)
    v = torch.ones(1, 1, 1, D, dtype=torch.float64)
    den = (q * D ** -0.25 * k * D ** -0.25).sum()
    assert 0 < den < 1e-6
    out = ops.approx_attention(q, k, v, eps=1e-6)
    num1 = (q * D ** -0.25 * k * D ** -0.25).sum()  # v = 1: numerator = q~.k~ v
    # one token, v = 1: o0 = 1, o1 = num1 / eps (guarded), o2 = phi(q~).phi(k~) / same = 1
    expected = (1.0 + num1 / 1e-6 + 1.0) * torch.ones(D, dtype=torch.float64)
    torch.testing.assert_close(out[0, 0, 0], expected)


# ---------------------------------------------------------------------------------------------
# nonapprox: long sequences with large |s|
# ---------------------------------------------------------------------------------------------
def test_nonapprox_large_scores_long_sequence():
    B, T, H, H_kv, D = 1, 2048, 2, 1, 8
    q, k, v = _qkv(B, T, H, H_kv, D, dtype=torch.float32, seed=8)
    # a drifting scale: |s| reaches hundreds and exp(s) overflows fp32 (and fp64 past ~710)
    scale = torch.linspace(1.0, 12.0, T).view(1, T, 1, 1)
    q, k = q * scale, k * scale
    s = token_scores(q, k)
    assert s.abs().max() > 200 and torch.isinf(torch.exp(s)).any()
    ref = nonapprox_attention_quadratic(q.double(), k.double(), v.double())
    for chunk in (64, 100):
        out = nonapprox_attention_chunked(q, k, v, chunk_size=chunk)[0]
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    state = ops.nonapprox_empty_state(B, H, D)
    _, state = ops.nonapprox_prefill(q[:, :2000], k[:, :2000], v[:, :2000], state)
    tail = [ops.nonapprox_decode_step(q[:, t], k[:, t], v[:, t], state) for t in range(2000, T)]
    torch.testing.assert_close(torch.stack(tail, 1).double(), ref[:, 2000:], rtol=1e-4, atol=1e-5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    nonapprox_attention_chunked(*leaves)[0].square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)


# ---------------------------------------------------------------------------------------------
# Decode states: prefill + token-by-token = full forward; Table 8 sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2)])
def test_prefill_then_decode_equals_full_forward(H, H_kv):
    B, T, D, split = 2, 21, 8, 9
    q, k, v = _qkv(B, T, H, H_kv, D, seed=9)
    cases = (
        (ops.approx_attention, ops.approx_prefill, ops.approx_decode_step,
         ops.approx_empty_state(B, H_kv, D, dtype=torch.float64)),
        (ops.nonapprox_attention, ops.nonapprox_prefill, ops.nonapprox_decode_step,
         ops.nonapprox_empty_state(B, H, D, dtype=torch.float64)),
    )
    for full_fn, prefill, step, empty in cases:
        full = full_fn(q, k, v)
        first, state = prefill(q[:, :5], k[:, :5], v[:, :5])  # two prefill chunks ...
        second, state = prefill(q[:, 5:split], k[:, 5:split], v[:, 5:split], state)
        assert state.length == split
        # ... then decode token by token
        rest = [step(q[:, t], k[:, t], v[:, t], state) for t in range(split, T)]
        assert state.length == T
        torch.testing.assert_close(torch.cat([first, second, torch.stack(rest, 1)], 1), full,
                                   rtol=1e-9, atol=1e-9)
        # decode from the very first token, too
        steps = [step(q[:, t], k[:, t], v[:, t], empty) for t in range(T)]
        torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("B,h,d_h", [(1, 4, 16), (3, 14, 64)])
def test_decode_state_sizes_are_table8(B, h, d_h):
    d = h * d_h
    approx = ops.approx_empty_state(B, h, d_h, dtype=torch.float16)
    nonapprox = ops.nonapprox_empty_state(B, h, d_h, dtype=torch.float16)
    assert approx.nbytes() == 6 * B * d + 4 * B * d * d // h
    assert nonapprox.nbytes() == 2 * B * d + 4 * B * h
    # the state a prefill hands over is the same size (kept in the empty state's dtype)
    q, k, v = _qkv(B, 5, h, h, d_h, dtype=torch.float16, seed=10)
    assert ops.approx_prefill(q, k, v, approx)[1].nbytes() == approx.nbytes()
    assert ops.nonapprox_prefill(q, k, v, nonapprox)[1].nbytes() == nonapprox.nbytes()
    # default fp32 storage: twice Table 8's half-precision bytes
    assert ops.approx_empty_state(B, h, d_h).nbytes() == 2 * approx.nbytes()
    assert ops.nonapprox_empty_state(B, h, d_h).nbytes() == 2 * nonapprox.nbytes()


def test_gqa_state_is_per_key_value_head_for_approx():
    B, H, H_kv, D = 2, 8, 2, 16
    q, k, v = _qkv(B, 3, H, H_kv, D, seed=11)
    _, state = ops.approx_prefill(q, k, v)
    assert state.kv1.shape == (B, H_kv, D, D) and state.sum_v.shape == (B, H_kv, D)
    _, state = ops.nonapprox_prefill(q, k, v)
    assert state.num.shape == (B, H, D) and state.den.shape == (B, H)


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------
def test_bad_arguments_name_the_argument():
    q, k, v = _qkv(1, 4, 2, 2, 4, dtype=torch.float32)
    for op in (ops.approx_attention, ops.nonapprox_attention):
        with pytest.raises(ValueError, match="impl"):
            op(q, k, v, impl="fast")
        with pytest.raises(ValueError, match="chunk_size"):
            op(q, k, v, chunk_size=0)
        with pytest.raises(ValueError, match="k"):
            op(q, k[:, :3], v)
    with pytest.raises(ValueError, match="eps"):
        ops.approx_attention(q, k, v, eps=0.0)
    with pytest.raises(ValueError, match="state"):
        ops.approx_prefill(q, k, v, ops.approx_empty_state(1, 1, 4))
    with pytest.raises(ValueError, match="state"):
        ops.nonapprox_decode_step(q[:, 0], k[:, 0], v[:, 0], ops.nonapprox_empty_state(2, 2, 4))
    with pytest.raises(ValueError, match="one token"):
        ops.nonapprox_decode_step(q, k, v, ops.nonapprox_empty_state(1, 2, 4))


# ---------------------------------------------------------------------------------------------
# Modules and models: one spawned single-rank world for everything, one TP=2 run
# ---------------------------------------------------------------------------------------------
APPROX_FP64 = {"attention_variant": "approx", "params_dtype": torch.float64}
PAPER_500M = dict(num_layers=1, hidden_size=896, num_attention_heads=14, num_query_groups=None,
                  ffn_hidden_size=4864)


def _attention_block(cfg, variant):
    from megatron.core.transformer.spec_utils import build_module

    import megatron_subq as subq

    spec = subq.VARIANTS[variant].attention_spec(cfg, 1, subq.get_spec_provider(False))
    return build_module(spec, config=cfg, layer_number=1)


def model_checks(train_steps: int) -> dict:
    """Everything that needs megatron's parallel state, in one process (TP=1)."""
    import megatron_subq as subq
    from megatron_subq.testing.equivalence import TINY, tiny_gpt_step

    out = {"approx_fp64_tp1": tiny_gpt_step(APPROX_FP64)}  # first: same RNG as a fresh rank

    # mlp's parameter match, counted on the built modules
    counts = {}
    for label, extra in (("tiny_gqa", {}), ("tiny_mha", {"num_query_groups": None}),
                         ("paper_500m", PAPER_500M)):
        cfg = subq.SubqTransformerConfig(**{**TINY, **extra, "attention_variant": "mlp"})
        attn, mlp = (_attention_block(cfg, v) for v in ("standard", "mlp"))
        counts[label] = {"standard": sum(p.numel() for p in attn.parameters()),
                         "mlp": sum(p.numel() for p in mlp.parameters()), "width": mlp.width}
    out["counts"] = counts

    # the mlp block is FC_dn(SiLU(FC_gt(h)) * FC_up(h)), row-wise (no token mixing)
    cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": "mlp"})
    mlp = _attention_block(cfg, "mlp")
    h = torch.randn(5, 2, 64)
    got, bias = mlp(h, attention_mask=None, rotary_pos_emb=None)
    gate, up = mlp.linear_fc1.weight.chunk(2, dim=0)
    ref = (F.silu(h @ gate.T) * (h @ up.T)) @ mlp.linear_fc2.weight.T
    out["mlp_block"] = (got.detach(), ref.detach(), bias)
    got_one, _ = mlp(h[2:3], attention_mask=None)
    out["mlp_row"] = (got_one.detach(), got[2:3].detach())

    # nonapprox's self-attention ignores RoPE; standard's does not
    cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": "nonapprox"})
    rope = torch.randn(5, 1, 1, 16)
    for variant in ("nonapprox", "standard"):
        torch.manual_seed(3)
        block = _attention_block(cfg, variant)
        h = torch.randn(5, 2, 64)
        with_rope = block(h, attention_mask=None, rotary_pos_emb=rope)[0]
        without = block(h, attention_mask=None, rotary_pos_emb=None)[0]
        out[f"rope_{variant}"] = (with_rope.detach(), without.detach())

    # 2-layer hybrids learn; then the skip ablation on the trained weights
    tokens, _, pos = repeating_batch()
    out["losses"], out["skip"] = {}, {}
    for name in ("mlp", "approx", "nonapprox"):
        torch.manual_seed(0)
        kwargs = {**TINY, "attention_variant": name, "layer_pattern": "hybrid"}
        model = subq.build_gpt_model(subq.SubqTransformerConfig(**kwargs), vocab_size=64,
                                     max_sequence_length=32)
        out["losses"][name] = fit_repeating_batch(model, train_steps)

        trained = model.state_dict()
        skipped = subq.build_gpt_model(
            subq.SubqTransformerConfig(**kwargs, skip_variant_layers=True), vocab_size=64,
            max_sequence_length=32)
        skipped.load_state_dict(trained, strict=True)  # same keys: loads the trained checkpoint
        # the reference: a 1-layer standard model holding the trained layer 2 (the standard one)
        alone = subq.build_gpt_model(subq.SubqTransformerConfig(**{**TINY, "num_layers": 1}),
                                     vocab_size=64, max_sequence_length=32)
        renamed = {key.replace("decoder.layers.1.", "decoder.layers.0."): value
                   for key, value in trained.items() if "decoder.layers.0." not in key}
        alone.load_state_dict(renamed, strict=True)
        for m in (model, skipped, alone):
            m.eval()
        with torch.no_grad():
            out["skip"][name] = {
                "hybrid": model(tokens, pos, None), "skipped": skipped(tokens, pos, None),
                "standard_only": alone(tokens, pos, None),
                "same_checkpoint_keys": set(skipped.sharded_state_dict()) == set(
                    model.sharded_state_dict()),
                "layer_types": [type(layer).__name__ for layer in skipped.decoder.layers]}
    return out


@pytest.fixture(scope="module")
def checks():
    return run_distributed(model_checks, 1, tp=1, args=(30,))[0]


def test_mlp_is_parameter_matched(checks):
    counts = checks["counts"]
    # TINY (hidden 64, 4 heads, 2 groups, head dim 16): 64*(64+2*32) + 64*64 = 12288 = 3*64*64
    assert counts["tiny_gqa"] == {"standard": 12288, "mlp": 12288, "width": 64}
    # paper 500M (hidden 896, 14 heads, MHA): 4*896^2 = 3,211,264 vs 3*896*1192 = 3,204,096
    assert counts["paper_500m"] == {"standard": 3211264, "mlp": 3204096, "width": 1192}
    for label, c in counts.items():
        assert abs(c["mlp"] - c["standard"]) <= 0.005 * c["standard"], (label, c)


def test_mlp_block_is_gated_silu_without_token_mixing(checks):
    got, ref, bias = checks["mlp_block"]
    assert bias is None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(*checks["mlp_row"], rtol=1e-6, atol=1e-6)


def test_nonapprox_ignores_rope(checks):
    torch.testing.assert_close(*checks["rope_nonapprox"], rtol=0, atol=0)
    assert not torch.allclose(*checks["rope_standard"])


def test_hybrids_train_with_falling_loss(checks):
    for name, losses in checks["losses"].items():
        assert all(math.isfinite(x) for x in losses), name
        assert losses[-1] < 0.6 * losses[0], (name, losses)


def test_skip_removes_the_variant_layers_of_a_trained_hybrid(checks):
    for name, r in checks["skip"].items():
        assert r["layer_types"] == ["SkippedTransformerLayer", "TransformerLayer"], name
        assert r["same_checkpoint_keys"], name
        torch.testing.assert_close(r["skipped"], r["standard_only"], rtol=1e-6, atol=1e-6,
                                   msg=name)
        assert not torch.allclose(r["skipped"], r["hybrid"], atol=1e-3), name


def test_approx_tp2_sp_equals_tp1_in_float64(checks):
    """The tight TP check of approx (its fp32 case in test_parallel_equivalence is looser)."""
    from megatron_subq.testing.equivalence import tiny_gpt_step

    ref = checks["approx_fp64_tp1"]
    ranks = run_distributed(tiny_gpt_step, 2, tp=2, args=({**APPROX_FP64,
                                                           "sequence_parallel": True},))
    for got in ranks:
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-9, atol=1e-9)
        assert set(got["grads"]) == set(ref["grads"])
        for pname, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][pname], g, rtol=1e-5,
                                       atol=1e-6 * g.abs().max().item(), msg=pname)
