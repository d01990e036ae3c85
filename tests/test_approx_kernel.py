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

Both chunk-state scans (launch option ``scan``: "parallel", the default, and "sequential") run
the ``test_scan_*`` tests: ragged lengths continuing an initial state and returning the final
one, GQA, several blocks of S per chunk, against the reference, and against each other
(the states themselves: equal up to summation order in fp32; ≤ 4e-3 apart in bf16, from the
parallel scan's bf16 deltas, in the interpreter).
"""


import json

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
    "sequential": ('{"scan": "sequential"}', 1),
    "sequential_recompute": ('{"scan": "sequential", "keep_states": false}', 1 + 1),
    "chunk128": ('{"BT": 128}', 1),  # 128-token chunks (the 16-bit default) on fp32 inputs
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


# "sequential" alone is also run by "sequential_recompute" and the scan-mode tests: an extra case
@pytest.mark.parametrize("option", [pytest.param(o, marks=pytest.mark.slow)
                                    if o == "sequential" else o for o in sorted(LAUNCH_ALONE)])
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
# the chunk-state scans: "parallel" (per-chunk deltas + kernels/scan.py's prefix sum), "sequential"
# ------------------------------------------------------------------------------------------
SCANS = ("parallel", "sequential")


def _scan_launch(monkeypatch, scan, **extra):
    """Select the scan (and other options) and count the parallel path's prefix sums (one in the
    forward, one in the backward), so that a test sees which path ran."""
    monkeypatch.setenv(LAUNCH_ENV, json.dumps({"scan": scan, **extra}))
    return _count_calls(monkeypatch, ("_forward_states", "_scan_pair"))


def _compare_continued(B, T0, T, H, H_kv, D, dtype=torch.float32, seed=11):
    """Prefill of T tokens continuing from the fp32 state after T0 earlier ones (T0 = 0: no
    initial state), with its final state, against the chunked fp32 reference from the same state
    on the same (rounded) inputs: o, dq, dk, dv and the final state. T = 1 without a state:
    dq = dk = 0 by the math, their largest absolute value is held to the bound."""
    state = None
    if T0:
        past = [a.detach().float() for a in _inputs(B, T0, H, H_kv, D, dtype, seed=seed)]
        _, state = approx_attention_chunked(*past)
    args = _inputs(B, T, H, H_kv, D, dtype, seed=seed + 1)
    o, st = ops.approx_prefill(*args, state=state, impl="kernel")
    d_out = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 2)).to(o)
    got = (o,) + torch.autograd.grad(o, args, d_out)
    ref_args = [a.detach().float().requires_grad_() for a in args]
    ref_o, ref_st = approx_attention_chunked(*ref_args, state=state)
    ref = (ref_o,) + torch.autograd.grad(ref_o, ref_args, d_out.float())
    bound = BOUNDS[dtype]
    errors = {name: rel_rms(x, r) for name, x, r in zip(NAMES, got, ref)}
    if T == 1 and not T0:
        errors["dq"], errors["dk"] = got[1].abs().max().item(), got[2].abs().max().item()
    assert st.length == ref_st.length == T0 + T
    for name, a, b in zip(("sum_v", "sum_k1", "sum_k2", "kv1", "kv2"), st.tensors(),
                          ref_st.tensors()):
        assert a.dtype == torch.float32 and a.is_contiguous(), name
        errors[name] = rel_rms(a, b)
    for name, x in zip(NAMES, got):
        assert x.dtype == dtype and torch.isfinite(x).all(), name
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"relative RMS above {bound}: {bad} (all: {errors})"
    return errors


# several [16, 16] blocks of S per chunk also at small D (D = 24 in 32: two per row and column,
# the second partly masked): the delta kernels' and the sequential scans' blocks
SMALL_BLOCKS = {"BK_delta": 16, "BV_delta": 16, "BK_state": 16, "BV_state": 16}
# (T0 earlier tokens in the initial state, T tokens): around the 64-token chunk, 5 chunks
SCAN_LENGTHS = [(50, 1), (50, 63), (50, 64), (50, 65), (50, 300), (0, 1), (0, 65), (0, 300)]


# the sequential scan (not the default) at the chunk boundary and over 5 chunks are extra cases
# (CI time); its 1-token and 65-token cases stay, and the two scans' states are compared below
SCAN_CASES = [pytest.param(scan, T0, T, id=f"{T0}-{T}-{scan}",
                           marks=[pytest.mark.slow] if scan == "sequential" and T in (63, 64, 300)
                           else [])
              for T0, T in SCAN_LENGTHS for scan in SCANS]


@pytest.mark.parametrize("scan,T0,T", SCAN_CASES)
def test_scan_modes_match_reference(scan, T0, T, monkeypatch):
    """Both scans, ragged lengths, GQA (G = 2), B = 2, padded D: forward, every gradient and the
    final state (chunked-prefill continuity: the initial state enters the prefix sums). Several
    blocks of S per chunk (``SMALL_BLOCKS``), as at D = 128 on a GPU; the other tests run the
    default blocks."""
    calls = _scan_launch(monkeypatch, scan, **SMALL_BLOCKS)
    _compare_continued(2, T0, T, 4, 2, 24)
    assert calls == {"_forward_states": 1, "_scan_pair": 2 if scan == "parallel" else 0}


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_scan_modes_half_dtypes(scan, dtype, monkeypatch):
    """The half dtypes on both scans, continuing a state; the parallel scan's deltas are bf16
    for bf16 inputs (deltas_half), fp32 for fp16 ones, the states in the input dtype."""
    seen = []
    _scan_launch(monkeypatch, scan)
    scan_pair = KERNEL.function._scan_pair

    def spy(delta, dz, *args, **kwargs):
        seen.append((delta.dtype, dz.dtype, args[-1]))
        return scan_pair(delta, dz, *args, **kwargs)

    monkeypatch.setattr(KERNEL.function, "_scan_pair", spy)
    _compare_continued(1, 70, 130, 4, 2, 32, dtype=dtype)
    if scan == "sequential":
        assert seen == []
    else:
        delta = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        assert seen == [(delta, torch.float32, dtype)] * 2


@pytest.mark.parametrize("chunk", [pytest.param(64, marks=pytest.mark.slow), 128])  # 64: extra
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_chunk_sizes_half_dtypes(dtype, chunk, monkeypatch):
    """128-token chunks (launch option BT; the default for 16-bit inputs since the H100 A/B of
    docs/benchmarks.md) and 64 (fp32's default, selectable): ragged (the last chunk partial),
    continuing a state, both half dtypes, forward, gradients and final state."""
    _scan_launch(monkeypatch, "parallel", BT=chunk)
    _compare_continued(1, 70, 300, 4, 2, 32, dtype=dtype)


def test_scan_deltas_half_off(monkeypatch):
    """deltas_half off: fp32 deltas for bf16 inputs, the same accuracy."""
    seen = []
    _scan_launch(monkeypatch, "parallel", deltas_half=False)
    scan_pair = KERNEL.function._scan_pair
    monkeypatch.setattr(KERNEL.function, "_scan_pair",
                        lambda d, z, *a, **k: seen.append(d.dtype) or scan_pair(d, z, *a, **k))
    _compare_continued(1, 0, 130, 2, 1, 32, dtype=torch.bfloat16)
    assert seen == [torch.float32] * 2


def test_scan_option_is_checked(monkeypatch):
    monkeypatch.setenv(LAUNCH_ENV, '{"scan": "blocked"}')
    args = _inputs(1, 8, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="scan='blocked'"):
        ops.approx_attention(*args, impl="kernel")


def _scan_states(scan, monkeypatch, B, T, H, H_kv, D, dtype, with_state, seed=21,
                 blocks=None):
    """The forward states (with the final state) and the backward's reverse states of one
    scan, computed by function.py's helpers on the same inputs, den and r (blocks: launch
    overrides, ``SMALL_BLOCKS`` unless given)."""
    blocks = SMALL_BLOCKS if blocks is None else blocks
    monkeypatch.setenv(LAUNCH_ENV, json.dumps({"scan": scan, **blocks}))
    fn = KERNEL.function
    cfg = fn.launch_config(D, dtype)
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_o = (torch.randn(B, T, h, D, generator=g).to(DEVICE, dtype)
                    for h in (H, H_kv, H_kv, H))
    state = None
    if with_state:
        state = (torch.randn(B, H_kv, 2, D, D, generator=g).to(DEVICE),
                 torch.randn(B, H_kv, 3, D, generator=g).to(DEVICE))
    s, zv, final = fn._forward_states(k, v, state, cfg, True)
    NT = s.shape[2]
    den = (torch.rand(B, H, 2, T, generator=g) + 0.5).to(DEVICE)  # away from the guard
    r = torch.randn(B, H, 2, T, generator=g).to(DEVICE)
    ds, dzv, _ = fn._reverse_states(q, d_o, den, r, cfg, H_kv, NT, 7, 1e-6)
    return {"S": s, "zv": zv, "S_final": final[0], "zv_final": final[1], "dS": ds, "dzv": dzv}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "state"])
def test_scan_parallel_and_sequential_states_agree(dtype, with_state, monkeypatch):
    """The two scans' chunk states, final states and reverse states (GQA sums, dsv's 1/n with
    length0 = 7), 4 ragged chunks, B = 2: the same up to summation order (fp32) or the
    parallel scan's bf16 deltas (bf16)."""
    shape = (2, 200, 4, 2, 24)
    par = _scan_states("parallel", monkeypatch, *shape, dtype, with_state)
    seq = _scan_states("sequential", monkeypatch, *shape, dtype, with_state)
    bound = 1e-6 if dtype == torch.float32 else 1e-2
    for name in par:
        a, b = par[name], seq[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        # chunk 0 of the forward states is the initial state (zeros without one), the last
        # chunk's reverse states are zeros: exactly, on both paths
        if name in ("S", "zv"):
            assert torch.equal(a[:, :, 0], b[:, :, 0]), name
        if name in ("dS", "dzv"):
            assert torch.equal(a[:, :, -1], torch.zeros_like(a[:, :, -1])), name
        err = rel_rms(a.float(), b.float())
        print(f"{name}: {err:.1e}")
        assert err < bound, (name, err)


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


@pytest.mark.gpu
@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_scan_modes_gpu(scan, dtype, monkeypatch):
    """Both scans at T = 4096 (64 chunks), D = 128 (the default 64 x 64 delta blocks), GQA,
    B = 2, continuing a 1000-token state, with the final state: o, every gradient and the final
    state against the chunked fp32 reference."""
    calls = _scan_launch(monkeypatch, scan)
    errors = _compare_continued(2, 1000, 4096, 8, 2, 128, dtype=dtype)
    assert calls["_scan_pair"] == (2 if scan == "parallel" else 0)
    print(f"{scan} {dtype}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("scan", SCANS)
def test_scan_modes_long_gpu(scan, monkeypatch):
    """16K tokens (256 chunks), bf16, GQA, with the final state: o, every gradient and the
    final state against the chunked fp32 reference."""
    calls = _scan_launch(monkeypatch, scan)
    errors = _compare_continued(1, 0, 16384, 8, 4, 128, dtype=torch.bfloat16)
    assert calls["_scan_pair"] == (2 if scan == "parallel" else 0)
    print(f"{scan} 16K bf16: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [4096, 16384])
def test_scan_parallel_and_sequential_states_agree_gpu(T, dtype, monkeypatch):
    """The two scans' chunk, final and reverse states on the compiled kernels at the default
    blocks (D = 128, GQA, an initial state)."""
    par = _scan_states("parallel", monkeypatch, 1, T, 8, 4, 128, dtype, True, blocks={})
    seq = _scan_states("sequential", monkeypatch, 1, T, 8, 4, 128, dtype, True, blocks={})
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    errors = {name: rel_rms(par[name].float(), seq[name].float()) for name in par}
    print(f"T={T} {dtype}: " + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert all(e < bound for e in errors.values()), errors


@pytest.mark.gpu
@pytest.mark.parametrize("scan", SCANS)
def test_scan_modes_cuda_graph_replay_gpu(scan, monkeypatch):
    """fwd+bwd of either scan captured in a CUDA graph and replayed on new values equals
    eager (the parallel path allocates its deltas and launches two more kernels per pass)."""
    _scan_launch(monkeypatch, scan)
    inputs = _inputs(1, 2048, 8, 2, 128, torch.bfloat16)
    grad_out = torch.randn(1, 2048, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    errors = graph_replay_matches_eager(
        lambda *a: ops.approx_attention(*a, impl="kernel"), inputs, grad_out)
    assert max(errors.values()) < 1e-6, errors

