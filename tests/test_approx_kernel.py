"""approx's Triton kernel against the fp32 reference: forward, every gradient, states, guards.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below before
the kernels are decorated, on small CPU shapes); the ``gpu``-marked tests cover large shapes and
the half dtypes' tensor-core paths on a GPU.

Error measure: relative RMS, ``‖x − ref‖₂ / ‖ref‖₂`` per output (o, dq, dk, dv), the reference
being the O(T²) definition ``approx_attention_quadratic`` computed in fp32 from the same (rounded)
inputs. o1's denominator ``q~_i · Σ_j k~_j`` has no sign: with zero-mean random q, k it comes
near 0 somewhere and the problem itself is ill-conditioned (outputs and gradients of 1e5 and
more, and the fp32 reference is then off from fp64 by ~3e-5). The accuracy tests therefore draw
q and k from N(1, 0.5²) (``OFFSET``, ``SPREAD``: all denominators far from 0); the ill-conditioned
case has its own test against fp64 (the kernel's error within 10× the fp32 reference's own), and
the guard ``|den| < eps → ±eps`` its own (large eps, so that many rows are guarded). Where a
gradient is zero by the math (T = 1: o_0 = v_0, so dq = dk = 0) its largest absolute value is
held to the bound. Bounds:

* fp32 inputs: 1e-5 (fp32 arithmetic throughout; seen ≤ 5e-7 in the interpreter, ≤ 1.5e-6 on an H100);
* fp16: 3e-3 (matmul operands — features, the [BT, BT] blocks, the chunk states — rounded to
  fp16 for the tensor cores, fp32 accumulation; seen ≤ 6e-4);
* bf16: 2e-2 (the same with bf16's 8-bit mantissa; seen ≤ 6e-3 in the interpreter, whose bf16
  dots go through fp32 — the GPU test checks the real bf16 tensor-core path against the same bound).
"""


import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_subq.testing.kernels import (  # noqa: E402
    BOUNDS,
    DEVICE,
    count_calls,
    graph_replay_matches_eager,
    kernel_package,
    rel_rms,
)

import megatron_subq as subq  # noqa: E402
from megatron_subq import ops  # noqa: E402
from megatron_subq.ops.approx import (  # noqa: E402
    ApproxState,
    approx_attention_chunked,
    approx_attention_quadratic,
    safe_denominator,
)

NAMES = ("o", "dq", "dk", "dv")
OFFSET, SPREAD = 1.0, 0.5  # q, k ~ N(1, 0.5²) in the accuracy tests: denominators far from 0


KERNEL = kernel_package("approx")



def _inputs(B, T, H, H_kv, D, dtype, seed=0, offset=OFFSET, spread=SPREAD):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (H, H_kv, H_kv))
    return [t.to(device=DEVICE, dtype=dtype).requires_grad_()
            for t in (q * spread + offset, k * spread + offset, v)]


def _out_and_grads(fn, args, d_out, dtype):
    """fn's output and the gradients of <out, d_out> w.r.t. args, computed in ``dtype``."""
    args = [a.detach().to(dtype).requires_grad_() for a in args]
    out = fn(*args)
    return (out,) + torch.autograd.grad(out, args, d_out.to(dtype))


def _run(args, eps, ref_dtype, seed):
    """(kernel out and grads, reference out and grads) for the same dO."""
    out = ops.approx_attention(*args, impl="kernel", eps=eps)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grads = torch.autograd.grad(out, args, d_out)
    ref = _out_and_grads(lambda *a: approx_attention_quadratic(*a, eps=eps), args, d_out,
                         ref_dtype)
    return (out,) + grads, ref


def _compare(shape, dtype, bound=None, seed=0, eps=1e-6, offset=OFFSET):
    """Kernel vs the O(T²) fp32 reference on the same rounded inputs: forward and all gradients."""
    args = _inputs(*shape, dtype=dtype, seed=seed, offset=offset)
    got, ref = _run(args, eps, torch.float32, seed)
    assert got[0].shape == args[0].shape
    bound = BOUNDS[dtype] if bound is None else bound
    errors = {name: rel_rms(x, r) for name, x, r in zip(NAMES, got, ref)}
    if shape[1] == 1:  # o_0 = v_0 whatever q, k are: dq = dk = 0 by the math
        errors["dq"], errors["dk"] = got[1].abs().max().item(), got[2].abs().max().item()
    for name, x in zip(NAMES, got):
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
    150: (1, 150, 2, 1, 16),  # 3 chunks: the state scans carry across chunks
}


@pytest.mark.parametrize("T", sorted(SMALL_SHAPES))
def test_kernel_matches_reference_fp32(T):
    _compare(SMALL_SHAPES[T], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernel_half_dtypes(dtype):
    _compare((1, 65, 2, 1, 32), dtype)


def test_kernel_ill_conditioned_inputs_against_fp64():
    """Zero-mean q, k: o1's denominator comes near 0, outputs and gradients reach 1e3+. Both the
    kernel and the fp32 reference then differ from fp64 by more than 1e-5; the kernel's error
    (a different summation order: chunks, fused multiply-adds on the GPU) must stay within 10× the
    fp32 reference's own (seen 2.4× in the interpreter)."""
    args = _inputs(1, 100, 2, 1, 24, torch.float32, seed=2, offset=0.0, spread=1.0)
    d_out = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got = _out_and_grads(lambda *a: ops.approx_attention(*a, impl="kernel"), args, d_out,
                         torch.float32)
    # the yardstick is fp32 arithmetic on the CPU (cuBLAS sums in another order on a GPU)
    cpu_args = [a.detach().cpu() for a in args]
    exact = _out_and_grads(approx_attention_quadratic, cpu_args, d_out.cpu(), torch.float64)
    ref32 = _out_and_grads(approx_attention_quadratic, cpu_args, d_out.cpu(), torch.float32)
    assert max(x.abs().max().item() for x in exact[1:]) > 1e3, "inputs not ill-conditioned"
    for name, x, ex, r32 in zip(NAMES, got, exact, ref32):
        assert torch.isfinite(x).all(), name
        kernel_err, ref_err = rel_rms(x.cpu(), ex), rel_rms(r32, ex)
        assert kernel_err <= 10 * ref_err, (name, kernel_err, ref_err)


def test_kernel_guards_denominators_like_the_reference():
    """eps = 0.5: many |den1| < eps rows (and q = 0 rows, where den1 = den2 = 0 exactly) are
    replaced by ±eps; kernel and reference agree on outputs and gradients, all finite."""
    args = _inputs(1, 70, 2, 1, 16, torch.float32, seed=6, offset=0.0, spread=1.0)
    with torch.no_grad():
        args[0][:, ::9] = 0.0  # q = 0: both denominators exactly 0
    eps = 0.5
    qs = args[0].detach() * 16 ** -0.25
    ks = args[1].detach() * 16 ** -0.25
    den1 = torch.einsum("bihd,bjhd->bhij", qs, ks.expand_as(qs)).tril().sum(-1)
    guarded = (den1.abs() < eps).float().mean().item()
    assert guarded > 0.1, f"only {guarded:.0%} of the rows guarded"
    assert torch.equal(safe_denominator(torch.zeros(1), eps), torch.full((1,), eps))
    got, ref = _run(args, eps, torch.float32, seed=6)
    for name, x, r in zip(NAMES, got, ref):
        assert torch.isfinite(x).all(), name
        assert rel_rms(x, r) < 1e-5, (name, rel_rms(x, r))


def test_kernel_prefill_and_decode_continue_each_other():
    q, k, v = (a.detach() for a in _inputs(2, 150, 4, 2, 16, torch.float32, seed=3))
    full = approx_attention_quadratic(q, k, v)
    o1, st = ops.approx_prefill(q[:, :70], k[:, :70], v[:, :70], impl="kernel")
    before = [t.clone() for t in st.tensors()]
    o2, st2 = ops.approx_prefill(q[:, 70:147], k[:, 70:147], v[:, 70:147], state=st,
                                 impl="kernel")
    assert all(torch.equal(a, b) for a, b in zip(before, st.tensors())), "input state modified"
    assert isinstance(st2, ApproxState) and st2.length == 147
    steps = [ops.approx_decode_step(q[:, t], k[:, t], v[:, t], st2) for t in range(147, 150)]
    got = torch.cat([o1, o2, torch.stack(steps, dim=1)], dim=1)
    assert rel_rms(got, full) < 1e-5
    _, ref_state = approx_attention_chunked(q, k, v)
    for name, a, b in zip(("sum_v", "sum_k1", "sum_k2", "kv1", "kv2"), st2.tensors(),
                          ref_state.tensors()):
        assert a.dtype == torch.float32 and rel_rms(a, b) < 1e-5, name


def test_kernel_keeps_the_state_dtype():
    """A half-precision state (Table 8's ``6Bd + 4Bd²/h`` bytes) comes back in its own dtype."""
    q, k, v = (a.detach() for a in _inputs(1, 20, 2, 2, 16, torch.float32, seed=4))
    state = ops.approx_empty_state(1, 2, 16, device=DEVICE, dtype=torch.float16)
    _, st = ops.approx_prefill(q, k, v, state=state, impl="kernel")
    _, ref = ops.approx_prefill(q, k, v, state=state, impl="reference")
    assert all(t.dtype == torch.float16 for t in st.tensors())
    assert st.nbytes() == ref.nbytes() == 2 * 2 * (3 * 16 + 2 * 16 * 16)
    for a, b in zip(st.tensors(), ref.tensors()):
        assert rel_rms(a, b) < BOUNDS[torch.float16]


def test_module_uses_the_kernel():
    """ApproxCoreAttention with subq_impl='kernel' equals the reference run (out and grads)."""
    from megatron_subq.variants.approx import ApproxCoreAttention

    results = []
    for impl in ("kernel", "reference"):
        cfg = subq.SubqTransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                         num_query_groups=2, attention_variant="approx",
                                         subq_impl=impl)
        core = ApproxCoreAttention(cfg, layer_number=1).to(DEVICE)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(9, 2, h, 16, generator=g).add(OFFSET).to(DEVICE).requires_grad_()
                   for h in (4, 2, 2))
        out = core(q, k, v, attention_mask=None)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out.detach(),) + grads)
    for got, ref in zip(*results):
        assert rel_rms(got, ref) < 1e-5


def test_kernel_rejects_bad_arguments():
    q, k, v = (a.detach() for a in _inputs(1, 4, 2, 2, 16, torch.float32))
    with pytest.raises(ValueError, match="dtype"):
        KERNEL.approx_attention_kernel(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head dim"):
        KERNEL.approx_attention_kernel(q, k, v[..., :8])
    with pytest.raises(ValueError, match="eps"):
        KERNEL.approx_attention_kernel(q, k, v, eps=0.0)
    with pytest.raises(ValueError, match="state"):
        KERNEL.approx_attention_kernel(q, k, v, state=ops.approx_empty_state(1, 1, 16))
    big = torch.zeros(1, 2, 1, 160)
    with pytest.raises(ValueError, match="head dim"):
        KERNEL.approx_attention_kernel(big, big, big)


# ------------------------------------------------------------------------------------------
# launch options ($MEGATRON_SUBQ_APPROX_LAUNCH)
# ------------------------------------------------------------------------------------------
LAUNCH_ENV = KERNEL.function.LAUNCH_ENV
# option -> (launch JSON, _forward_states calls in fwd + bwd): kept states (the default) spare
# the recompute
LAUNCH_ALONE = {
    "default": ("{}", 1),
    "recompute": ('{"keep_states": false}', 1 + 1),
}


def _count_calls(monkeypatch, names=("_forward_states",)):
    """Calls of function.py's state helpers (``count_calls``)."""
    return count_calls(monkeypatch, KERNEL.function, names)


def _compare_with_state(B, T0, T, H, H_kv, D, seed=7):
    """The kernel continuing from the reference's state after T0 tokens (so length0 = T0 enters
    o0's 1/n) against the chunked fp32 reference from the same state: o, all gradients and the
    final state."""
    q0, k0, v0 = (a.detach() for a in _inputs(B, T0, H, H_kv, D, torch.float32, seed=seed))
    _, state = approx_attention_chunked(q0, k0, v0)
    args = _inputs(B, T, H, H_kv, D, torch.float32, seed=seed + 1)
    o, st = ops.approx_prefill(*args, state=state, impl="kernel")
    d_out = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 2)).to(o)
    got = (o,) + torch.autograd.grad(o, args, d_out)
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    ref_o, ref_st = approx_attention_chunked(*ref_args, state=state)
    ref = (ref_o,) + torch.autograd.grad(ref_o, ref_args, d_out)
    for name, x, r in zip(NAMES, got, ref):
        assert rel_rms(x, r) < BOUNDS[torch.float32], (name, rel_rms(x, r))
    assert st.length == ref_st.length == T0 + T
    for a, b in zip(st.tensors(), ref_st.tensors()):
        assert rel_rms(a, b) < BOUNDS[torch.float32]


@pytest.mark.parametrize("option", sorted(LAUNCH_ALONE))
def test_launch_option_alone(option, monkeypatch):
    """3 chunks, GQA, B = 2: the kept states are read at every (batch, head, chunk) offset."""
    launch, expected = LAUNCH_ALONE[option]
    monkeypatch.setenv(LAUNCH_ENV, launch)
    calls = _count_calls(monkeypatch)
    _compare((2, 130, 4, 2, 16), torch.float32)
    assert calls == {"_forward_states": expected}


@pytest.mark.parametrize("option", sorted(LAUNCH_ALONE))
def test_launch_option_with_initial_state(option, monkeypatch):
    """Gradients through a prefill that continues from a state (the states kept include it)."""
    launch, expected = LAUNCH_ALONE[option]
    monkeypatch.setenv(LAUNCH_ENV, launch)
    calls = _count_calls(monkeypatch)
    _compare_with_state(1, 50, 100, 4, 2, 16)
    assert calls == {"_forward_states": expected}


# ------------------------------------------------------------------------------------------
# GPU: large shapes, the real half-precision tensor-core paths
# ------------------------------------------------------------------------------------------
GPU_SHAPES = [
    (2, 1000, 8, 2, 128),
    (1, 4096, 4, 4, 128),
    (1, 777, 4, 1, 96),
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
    """16K tokens against the chunked fp32 reference."""
    args = _inputs(1, 16384, 4, 2, 128, torch.bfloat16, seed=5)
    out = ops.approx_attention(*args, impl="kernel")
    ref = approx_attention_chunked(*(a.detach().float() for a in args))[0]
    assert rel_rms(out, ref) < BOUNDS[torch.bfloat16]


@pytest.mark.gpu
def test_prefill_decode_gpu_bf16():
    q, k, v = (a.detach() for a in _inputs(2, 300, 8, 2, 128, torch.bfloat16))
    full = ops.approx_attention(q, k, v, impl="kernel")
    o1, st = ops.approx_prefill(q[:, :200], k[:, :200], v[:, :200], impl="kernel")
    steps = [ops.approx_decode_step(q[:, t], k[:, t], v[:, t], st) for t in range(200, 300)]
    got = torch.cat([o1, torch.stack(steps, dim=1)], dim=1)
    assert rel_rms(got, full) < BOUNDS[torch.bfloat16]


@pytest.mark.gpu
def test_launch_option_keep_states_gpu_bf16(monkeypatch):
    """keep_states on the real bf16 tensor-core path (S kept in bf16), GQA."""
    monkeypatch.setenv(LAUNCH_ENV, '{"keep_states": true}')
    calls = _count_calls(monkeypatch)
    errors = _compare(GPU_SHAPES[0], torch.bfloat16)
    assert calls == {"_forward_states": 1}
    print(f"keep_states {GPU_SHAPES[0]} bf16: "
          + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    """fwd+bwd captured in a CUDA graph and replayed on new values equals eager."""
    inputs = _inputs(1, 2048, 8, 2, 128, torch.bfloat16)
    grad_out = torch.randn(1, 2048, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    errors = graph_replay_matches_eager(
        lambda *a: ops.approx_attention(*a, impl="kernel"), inputs, grad_out)
    assert max(errors.values()) < 1e-6, errors
