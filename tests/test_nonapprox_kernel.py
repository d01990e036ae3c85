"""nonapprox's Triton kernel against the fp32 reference: forward, every gradient, states, dispatch.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below before
the kernels are decorated, on small CPU shapes); the ``gpu``-marked tests cover large shapes and
the half dtypes' tensor-core paths on a GPU.

Error measure: relative RMS, ``‖x − ref‖₂ / ‖ref‖₂`` per output (o, dq, dk, dv), the reference
being the O(T²) definition ``nonapprox_attention_quadratic`` computed in fp32 from the same (rounded)
inputs — except where a gradient is zero by the math (T = 1: o_0 = v_0, so dq = dk = 0), where
its largest absolute value is held to the same bound (inputs and dO are O(1)). Bounds:

* fp32 inputs: 1e-5 (fp32 arithmetic throughout; seen ≤ 6e-7 in the interpreter, ≤ 1.5e-6 on an
  H100);
* fp16: 3e-3 (the [BT, BT] softmax weights and dO/v rounded to fp16 for the tensor-core products,
  fp32 accumulation; seen ≤ 4e-4);
* bf16: 2e-2 (the same with bf16's 8-bit mantissa; seen ≤ 4e-3 in the interpreter, whose bf16
  dots go through fp32, and ≤ 3.2e-3 on an H100's bf16 tensor cores).

Large |s| (inputs × 8: scores up to ~±150, where a plain e^{s} overflows fp32 beyond 88): against
an fp64 reference, 2e-5 (seen ≤ 6e-6: fp32 rounding of s is amplified by e^{s} in the gradients).
"""


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

import megatron_subq as subq  # noqa: E402
from megatron_subq import ops  # noqa: E402
from megatron_subq.ops.nonapprox import (  # noqa: E402
    NonapproxState,
    nonapprox_attention_chunked,
    nonapprox_attention_quadratic,
)

NAMES = ("o", "dq", "dk", "dv")


KERNEL = kernel_package("nonapprox")



def _inputs(B, T, H, H_kv, D, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(B, T, h, D, generator=g) * scale for h in (H, H_kv, H_kv)]
    return [t.to(device=DEVICE, dtype=dtype).requires_grad_() for t in tensors]


def _compare(shape, dtype, bound=None, seed=0, scale=1.0, ref_dtype=torch.float32):
    """Kernel vs the O(T²) reference on the same rounded inputs: forward and all gradients."""
    args = _inputs(*shape, dtype=dtype, seed=seed, scale=scale)
    out = ops.nonapprox_attention(*args, impl="kernel")
    assert out.dtype == dtype and out.shape == args[0].shape
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grads = torch.autograd.grad(out, args, d_out)
    ref_args = [a.detach().to(ref_dtype).requires_grad_() for a in args]
    ref = nonapprox_attention_quadratic(*ref_args)
    ref_grads = torch.autograd.grad(ref, ref_args, d_out.to(ref_dtype))
    bound = BOUNDS[dtype] if bound is None else bound
    errors = {name: rel_rms(x, r) for name, x, r in zip(NAMES, (out,) + grads, (ref,) + ref_grads)}
    if shape[1] == 1:  # o_0 = v_0 whatever q, k are: dq = dk = 0 by the math
        errors["dq"], errors["dk"] = grads[0].abs().max().item(), grads[1].abs().max().item()
    for name, x in zip(NAMES, (out,) + grads):
        assert x.dtype == dtype, f"{name} has dtype {x.dtype}"
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"relative RMS above {bound}: {bad} (all: {errors})"
    return errors


# (B, T, H, H_kv, D): T around the 64-token chunk, GQA, padded D
SMALL_SHAPES = {
    1: (2, 1, 2, 1, 16),
    63: (1, 63, 2, 2, 24),
    64: (2, 64, 4, 2, 16),
    65: (1, 65, 3, 1, 32),
    200: (1, 200, 2, 1, 72),  # D > 64: 32-token chunks (7), the scans carry across them
}


@pytest.mark.parametrize("T", sorted(SMALL_SHAPES))
def test_kernel_matches_reference_fp32(T):
    _compare(SMALL_SHAPES[T], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernel_half_dtypes(dtype):
    _compare((1, 65, 2, 1, 32), dtype)


def test_kernel_is_stable_for_large_scores():
    """|s| up to ~150: e^{s} overflows fp32, the running max / lse keep it finite; the reference
    here is fp64, so the bound measures the kernel's own error."""
    _compare((1, 150, 2, 1, 32), torch.float32, bound=2e-5, scale=8.0, ref_dtype=torch.float64)


def test_kernel_prefill_and_decode_continue_each_other():
    q, k, v = (a.detach() for a in _inputs(2, 150, 4, 2, 16, torch.float32, seed=3))
    full = nonapprox_attention_quadratic(q, k, v)
    o1, st = ops.nonapprox_prefill(q[:, :70], k[:, :70], v[:, :70], impl="kernel")
    before = [t.clone() for t in st.tensors()]
    o2, st2 = ops.nonapprox_prefill(q[:, 70:147], k[:, 70:147], v[:, 70:147], state=st,
                                    impl="kernel")
    assert all(torch.equal(a, b) for a, b in zip(before, st.tensors())), "input state modified"
    assert isinstance(st2, NonapproxState) and st2.length == 147
    steps = [ops.nonapprox_decode_step(q[:, t], k[:, t], v[:, t], st2) for t in range(147, 150)]
    got = torch.cat([o1, o2, torch.stack(steps, dim=1)], dim=1)
    assert rel_rms(got, full) < 1e-5
    _, ref_state = nonapprox_attention_chunked(q, k, v)
    for name, a, b in zip(("num", "den", "max"), st2.tensors(), ref_state.tensors()):
        assert a.dtype == torch.float32 and rel_rms(a, b) < 1e-5, name


def test_kernel_keeps_the_state_dtype():
    """A half-precision state (Table 8's byte count) comes back in its own dtype."""
    q, k, v = (a.detach() for a in _inputs(1, 20, 2, 1, 16, torch.float32, seed=4))
    state = ops.nonapprox_empty_state(1, 2, 16, device=DEVICE, dtype=torch.bfloat16)
    _, st = ops.nonapprox_prefill(q, k, v, state=state, impl="kernel")
    _, ref = ops.nonapprox_prefill(q, k, v, state=state, impl="reference")
    assert all(t.dtype == torch.bfloat16 for t in st.tensors())
    assert st.nbytes() == ref.nbytes() == 2 * (2 * 16 + 2 * 2)
    for a, b in zip(st.tensors(), ref.tensors()):
        assert rel_rms(a, b) < BOUNDS[torch.bfloat16]


def test_module_uses_the_kernel():
    """NonapproxCoreAttention with subq_impl='kernel' equals the reference run (out and grads)."""
    from megatron_subq.variants.nonapprox import NonapproxCoreAttention

    results = []
    for impl in ("kernel", "reference"):
        cfg = subq.SubqTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                         num_query_groups=2, attention_variant="nonapprox",
                                         subq_impl=impl)
        core = NonapproxCoreAttention(cfg, layer_number=1).to(DEVICE)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(9, 2, h, 16, generator=g).to(DEVICE).requires_grad_()
                   for h in (4, 2, 2))
        out = core(q, k, v, attention_mask=None)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out.detach(),) + grads)
    for got, ref in zip(*results):
        assert rel_rms(got, ref) < 1e-5


def test_kernel_rejects_bad_arguments():
    q, k, v = (a.detach() for a in _inputs(1, 4, 2, 2, 16, torch.float32))
    with pytest.raises(ValueError, match="dtype"):
        KERNEL.nonapprox_attention_kernel(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head dim"):
        KERNEL.nonapprox_attention_kernel(q, k, v[..., :8])
    with pytest.raises(ValueError, match="state"):
        KERNEL.nonapprox_attention_kernel(q, k, v, state=ops.nonapprox_empty_state(1, 1, 16))


# ------------------------------------------------------------------------------------------
# GPU: large shapes, the real half-precision tensor-core paths
# ------------------------------------------------------------------------------------------
GPU_SHAPES = [
    (2, 1000, 8, 2, 128),
    (1, 4096, 4, 4, 128),
    (1, 777, 4, 1, 256),
    (3, 63, 2, 2, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference_gpu(shape, dtype):
    errors = _compare(shape, dtype)
    print(f"{shape} {dtype}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))


@pytest.mark.gpu
def test_kernel_long_sequence_gpu():
    """16K tokens with large scores against the chunked fp32 reference (O(T·C) memory)."""
    args = _inputs(1, 16384, 4, 2, 128, torch.bfloat16, seed=5, scale=3.0)
    out = ops.nonapprox_attention(*args, impl="kernel")
    ref = nonapprox_attention_chunked(*(a.detach().float() for a in args))[0]
    assert rel_rms(out, ref) < BOUNDS[torch.bfloat16]


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    """fwd+bwd captured in a CUDA graph and replayed on new values equals eager (no host sync,
    no stale host-held value)."""
    inputs = _inputs(1, 2048, 8, 2, 128, torch.bfloat16)
    grad_out = torch.randn(1, 2048, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    errors = graph_replay_matches_eager(
        lambda *a: ops.nonapprox_attention(*a, impl="kernel"), inputs, grad_out)
    assert max(errors.values()) < 1e-6, errors


@pytest.mark.gpu
def test_prefill_decode_gpu_bf16():
    q, k, v = (a.detach() for a in _inputs(2, 300, 8, 2, 128, torch.bfloat16))
    full = ops.nonapprox_attention(q, k, v, impl="kernel")
    o1, st = ops.nonapprox_prefill(q[:, :200], k[:, :200], v[:, :200], impl="kernel")
    steps = [ops.nonapprox_decode_step(q[:, t], k[:, t], v[:, t], st) for t in range(200, 300)]
    got = torch.cat([o1, torch.stack(steps, dim=1)], dim=1)
    assert rel_rms(got, full) < BOUNDS[torch.bfloat16]
