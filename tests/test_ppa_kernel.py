"""PPA's Triton kernel against the O(T²) reference: forward, every gradient, the offset plan.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below before
triton is imported) on small CPU shapes with 16x16 tiles, so T = 1, 15..17, 63..65 cross tile
edges; the ``gpu``-marked tests run the GPU launch configuration (64x64 tiles, D = 128) at longer
T and GQA 32/2.

Error measure: relative RMS ``‖x − ref‖₂ / ‖ref‖₂`` per output (o, dq, dk, dv), the reference
being ``ppa_attention_masked`` in fp32 on the same (rounded) inputs, except where a gradient is
zero by the math (T = 1: one key, so dq = dk = 0), where its largest absolute value is held to the
bound. Bounds:

* fp32: 1e-5 (fp32 arithmetic, ieee dots; seen <= 3.1e-7 in the interpreter);
* fp16: 3e-3 (fp16 tile operands, fp32 accumulation; seen <= 4.2e-4);
* bf16: 2e-2 (bf16 tile operands, 8-bit mantissa; seen <= 7.8e-3 in the interpreter, whose bf16
  dots run on fp32 copies of the rounded operands — the GPU tests check the real bf16
  tensor-core path against the same bound).
"""


import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_subq.testing.kernels import (  # noqa: E402
    BOUNDS,
    DEVICE,
    graph_replay_matches_eager,
    kernel_package,
    rel_rms,
)

from megatron_subq import ops  # noqa: E402
from megatron_subq.ops.ppa import (ppa_attention_masked, ppa_attention_reference,  # noqa: E402
                                   ppa_offsets)

NAMES = ("o", "dq", "dk", "dv")


KERNEL = kernel_package("ppa")



def _inputs(B, T, H, H_kv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, T, H, D), (B, T, H_kv, D), (B, T, H_kv, D))
    return [torch.randn(s, generator=g).to(device=DEVICE, dtype=dtype).requires_grad_()
            for s in shapes]


def _compare(shape, power, window, dtype, seed=0, reference=ppa_attention_masked, **kernel_kw):
    """Kernel vs the fp32 reference on the same rounded inputs: output and all gradients."""
    q, k, v = _inputs(*shape, dtype=dtype, seed=seed)
    out = KERNEL.ppa_attention_kernel(q, k, v, power, window, **kernel_kw)
    assert out.dtype == dtype and out.shape == q.shape
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)

    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = reference(*ref_in, power, window)
    ref_grads = torch.autograd.grad(ref, ref_in, d_out.float())
    bound = BOUNDS[dtype]
    for name, got, want in zip(NAMES, (out,) + grads, (ref,) + ref_grads):
        assert torch.isfinite(got).all(), f"{name}: non-finite values"
        if want.abs().max() < 1e-6:  # zero by the math (T = 1)
            assert got.abs().max().item() <= bound, f"{name} should be 0"
            continue
        err = rel_rms(got, want)
        assert err <= bound, f"{name}: relative RMS {err:.2e} > {bound:.0e}"


# (B, T, H, H_kv, D), p, w, dense_gap: each case says which path it exercises
CASES = [
    ((1, 1, 2, 1, 16), 0.5, 2, 8),  # one token: dq = dk = 0
    ((1, 17, 2, 2, 16), 0.5, 0, 0),  # reach 0: every offset >= 1 is a diagonal
    ((2, 63, 4, 2, 16), 0.5, 4, 8),  # reach 16 (offsets 9, 16 join the band; lookup), far 25..49
    ((1, 64, 2, 1, 16), 0.75, 3, 2),  # p = 3/4: a short dense reach, many diagonals, GQA 2
    ((1, 65, 2, 2, 32), 1.0, 0, 8),  # p = 1: all dense, no lookup (full causal)
    ((1, 65, 4, 1, 16), 0.0, 5, 8),  # p = 0: sliding window of 6, GQA 4
    ((1, 50, 2, 1, 24), 1 / 3, 1, 100),  # D = 24 (padded to 32); everything in the lookup tiles
]


@pytest.mark.parametrize("shape,power,window,gap", CASES,
                         ids=[f"T{c[0][1]}-p{c[1]:.2f}-w{c[2]}-gap{c[3]}" for c in CASES])
def test_kernel_matches_reference_fp32(shape, power, window, gap):
    _compare(shape, power, window, torch.float32, dense_gap=gap)


def test_kernel_rectangular_tiles():
    _compare((1, 47, 2, 1, 16), 0.5, 2, torch.float32, dense_gap=0, block_m=32, block_n=16)
    _compare((1, 47, 2, 1, 16), 0.625, 2, torch.float32, dense_gap=4, block_m=16, block_n=32)


def test_kernel_strided_inputs():
    """q, k, v as views of one fused [B, T, H + 2 H_kv, D] projection (megatron's layout)."""
    B, T, H, H_kv, D = 2, 40, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    fused = torch.randn(B, T, H + 2 * H_kv, D, generator=g).to(DEVICE).requires_grad_()
    q, k, v = fused.split([H, H_kv, H_kv], dim=2)
    out = KERNEL.ppa_attention_kernel(q, k, v, 0.5, 2)
    ref = ppa_attention_masked(q, k, v, 0.5, 2)
    assert rel_rms(out, ref) <= 1e-5
    d_out = torch.randn(out.shape, generator=g).to(out)
    (got,) = torch.autograd.grad(out, fused, d_out)
    (want,) = torch.autograd.grad(ref, fused, d_out)
    assert rel_rms(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernel_half_dtypes(dtype):
    _compare((1, 65, 4, 2, 16), 0.5, 4, dtype, dense_gap=8)


def _per_sequence_masked(q, k, v, cu, power, window):
    """Each packed sequence through the O(T²) form on its own, concatenated."""
    bounds = cu.tolist()
    return torch.cat([ppa_attention_masked(q[:, a:b], k[:, a:b], v[:, a:b], power, window)
                      for a, b in zip(bounds, bounds[1:]) if b > a], dim=1)


@pytest.mark.parametrize("power,window,gap", [(0.5, 2, 0), (0.75, 1, 8)])
def test_kernel_packed_sequences(power, window, gap):
    """Variable-length batch: sequences of 5, 0, 27 and 18 tokens packed along T (B = 1)."""
    cu = torch.tensor([0, 5, 5, 32, 50], dtype=torch.int32, device=DEVICE)
    q, k, v = _inputs(1, 50, 4, 2, 16, torch.float32, seed=11)
    out = ops.ppa_attention(q, k, v, power, window, impl="kernel", cu_seqlens=cu)
    ref = _per_sequence_masked(q, k, v, cu, power, window)
    assert rel_rms(out, ref) <= 1e-5
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).to(out)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    want = torch.autograd.grad(ref, (q, k, v), d_out)
    for name, g, r in zip("qkv", got, want):
        assert rel_rms(g, r) <= 1e-5, f"d{name}"
    # the reference op takes the same packed batch
    torch.testing.assert_close(ops.ppa_attention(q, k, v, power, window, impl="reference",
                                                 cu_seqlens=cu), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.ppa_attention(q, k, v, power, window, cu_seqlens=torch.tensor([0, 7, 40]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.ppa_attention(q, k, v, power, window, cu_seqlens=torch.tensor([0, 30, 20, 50]))


def test_dispatch():
    q, k, v = _inputs(1, 20, 2, 1, 16, torch.float32, seed=3)
    via_op = ops.ppa_attention(q, k, v, 0.5, 2, impl="kernel")
    direct = KERNEL.ppa_attention_kernel(q, k, v, 0.5, 2)
    torch.testing.assert_close(via_op, direct, rtol=0, atol=0)
    if DEVICE == "cpu":  # impl=None: the reference on CPU tensors, even under the interpreter
        torch.testing.assert_close(ops.ppa_attention(q, k, v, 0.5, 2),
                                   ppa_attention_reference(q, k, v, 0.5, 2), rtol=0, atol=0)


def test_bad_kernel_arguments():
    q, k, v = _inputs(1, 8, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="block_m"):
        KERNEL.ppa_attention_kernel(q, k, v, 0.5, 2, block_m=24)
    with pytest.raises(ValueError, match="dense_gap"):
        KERNEL.ppa_attention_kernel(q, k, v, 0.5, 2, dense_gap=-1)


# ---------------------------------------------------------------------------------------------
# the offset plan (host side, no kernel launch)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("power,window,gap,T", [(0.5, 64, 8, 8192), (0.5, 4, 8, 100),
                                                 (0.75, 3, 8, 5000), (1.0, 0, 8, 300),
                                                 (0.0, 7, 8, 300), (1 / 3, 0, 0, 1000)])
def test_offset_plan_covers_the_mask_once(power, window, gap, T):
    from fractions import Fraction

    p = Fraction(power).limit_denominator(1000)
    plan = KERNEL.offset_plan(p, window, T, gap, 16, 16, torch.device("cpu"))
    offsets = set(ppa_offsets(power, T - 1))
    R = plan.dense_reach
    assert R >= min(window, T - 1)
    attended = plan.attended.numpy().astype(bool)
    want = np.array([d <= window or d in offsets for d in range(R + 1)])
    np.testing.assert_array_equal(attended, want)
    far = plan.far.numpy()[: plan.n_far].tolist()
    assert far == sorted(s for s in offsets if s > R)  # every offset exactly once
    # gaps: every offset that joined the dense reach lies <= gap past the previous one
    assert all(s - prev <= gap for prev, s in zip([window] + sorted(o for o in offsets
               if window < o <= R), sorted(o for o in offsets if window < o <= R)))
    if power == 0.5 and window == 64:
        assert R == 64 and plan.n_far == 90 - 8
    if power == 1.0:
        assert R == T - 1 and plan.n_far == 0 and not plan.use_lookup
    counts = plan.far_count_q.numpy()
    for blk, n in enumerate(counts):  # diagonals that reach a key from query block blk
        last = min(T - 1, blk * 16 + 15)
        assert n == sum(1 for s in far if s <= last)


# ---------------------------------------------------------------------------------------------
# on a GPU: the real launch configuration at longer sequences
# ---------------------------------------------------------------------------------------------
def _chunked_reference(q, k, v, power, window):
    return ppa_attention_reference(q, k, v, power, window)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape,power,window", [
    ((1, 4096, 16, 16, 128), 0.5, 64),  # the training shape (p = 1/2, w = 64)
    ((2, 1000, 8, 8, 64), 0.75, 16),
    ((1, 2048, 32, 2, 128), 0.5, 64),  # Nemotron GQA 32/2
    ((1, 1537, 4, 4, 128), 1.0, 0),
    ((1, 1537, 4, 2, 128), 0.0, 64),
])
def test_kernel_gpu(shape, power, window, dtype):
    _compare(shape, power, window, dtype, reference=_chunked_reference)


@pytest.mark.gpu
def test_kernel_gpu_long_forward_matches_dense_at_p1():
    q, k, v = _inputs(1, 16384, 8, 8, 128, torch.bfloat16)
    with torch.no_grad():
        out = KERNEL.ppa_attention_kernel(q, k, v, 1.0, 64)
        ref = ops.standard_attention(q, k, v)
    assert rel_rms(out, ref) <= BOUNDS[torch.bfloat16]


@pytest.mark.gpu
def test_kernel_gpu_packed_sequences():
    cu = torch.tensor([0, 1000, 1001, 3000, 4096], dtype=torch.int32, device=DEVICE)
    q, k, v = _inputs(1, 4096, 16, 4, 128, torch.bfloat16, seed=5)
    out = ops.ppa_attention(q, k, v, 0.5, 64, impl="kernel", cu_seqlens=cu)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = ops.ppa_attention(*ref_in, 0.5, 64, impl="reference", cu_seqlens=cu)
    ref_grads = torch.autograd.grad(ref, ref_in, d_out.float())
    for name, got, want in zip(NAMES, (out,) + grads, (ref,) + ref_grads):
        assert rel_rms(got, want) <= BOUNDS[torch.bfloat16], name


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    """fwd+bwd captured in a CUDA graph and replayed on new values equals eager (no host sync,
    no stale host-held value), as for the linear-time ops."""
    inputs = _inputs(1, 2048, 8, 2, 128, torch.bfloat16)
    grad_out = torch.randn(1, 2048, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    errors = graph_replay_matches_eager(
        lambda *a: ops.ppa_attention(*a, power=0.5, window=64, impl="kernel"), inputs, grad_out)
    assert max(errors.values()) < 1e-6, errors
