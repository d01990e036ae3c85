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
        w = torch.randn(1, 11, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        grads = []
        for fn in (fast, slow):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            (fn(*leaves) * w).sum().backward()
            grads.append([t.grad for t in leaves])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *a: approx_attention_chunked(*a, chunk_size=4)[0],
                                    leaves)
    assert torch.autograd.gradcheck(lambda *a: nonapprox_attention_chunked(*a, chunk_size=4)[0],
                                    leaves)


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
    o2 = 1.0  # o2 = phi(q~)(phi(k~)^T v) / phi(q~).phi(k~) = v for a single token
    torch.testing.assert_close(out[0, 0, 0], 1.0 + num1 / 1e-6 + o2 * torch.ones(D,
                                                                                  dtype=torch.float64))


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
        rest = [step(q[:, t], k[:, t], v[:, t], state) for t in range(split, T)]  # ... then decode
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
        with pytest.raises(ValueError, match="kernel"):
            op(q, k, v, impl="kernel")  # no Triton kernel yet (issue 6)
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
