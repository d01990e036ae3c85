"""Gradients through the states of approx's, nonapprox's and asa's Triton kernels (context
parallelism's state passing trains through them): the kernel's gradients w.r.t. q, k, v (asa:
also p_q, p_k) AND the initial state, with a loss that also uses the final state, against the
chunked PyTorch reference's autograd (asa: each normalisation).

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``). Inputs: ragged lengths (not multiples of the 64- or 32-token chunk),
GQA (H = 4, H_kv = 2), padded D, an initial state that the reference computed from earlier
tokens. Error measure and bounds: relative RMS per tensor, ``megatron_subq.testing.kernels``
(fp32 1e-5, fp16 3e-3). Also: a loss that uses only the final state (o gets no gradient), and
the no-state path untouched (no initial/final state: bit for bit the gradients it gave before,
with no gradient on a state).
"""

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from megatron_subq.testing.kernels import BOUNDS, DEVICE, kernel_package, rel_rms  # noqa: E402

from megatron_subq import ops  # noqa: E402
from megatron_subq.ops.approx import ApproxState, approx_attention_chunked  # noqa: E402
from megatron_subq.ops.nonapprox import NonapproxState, nonapprox_attention_chunked  # noqa: E402

APPROX = kernel_package("approx")
NONAPPROX = kernel_package("nonapprox")
OFFSET, SPREAD = 1.0, 0.5  # approx: q, k ~ N(1, 0.5²), denominators far from 0 (its tests' rule)


def _qkv(B, T, H, H_kv, D, dtype, seed, offset=0.0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (H, H_kv, H_kv))
    return [t.to(device=DEVICE, dtype=dtype).requires_grad_()
            for t in (q * spread + offset, k * spread + offset, v)]


def _weights(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=g).to(t.device) for t in tensors]


def _run(variant, args, state_tensors, length0, use_o, use_final, impl, w_o, w_final):
    """o and the final state of ``variant`` (kernel: ops.*_prefill; reference: the chunked
    form) continuing from the state; the loss <o, w_o> (use_o) + Σ <final_i, w_i> (use_final);
    its gradients w.r.t. q, k, v and the initial state's tensors."""
    if variant == "approx":
        state = ApproxState(*state_tensors, length=length0)
        if impl == "kernel":
            o, final = ops.approx_prefill(*args, state=state, impl="kernel")
        else:
            o, final = approx_attention_chunked(*args, state=state)
    else:
        state = NonapproxState(*state_tensors, length=length0)
        if impl == "kernel":
            o, final = ops.nonapprox_prefill(*args, state=state, impl="kernel")
        else:
            o, final = nonapprox_attention_chunked(*args, state=state)
    loss = 0.0
    if use_o:
        loss = loss + (o.float() * w_o).sum()
    if use_final:
        loss = loss + sum((t.float() * w).sum() for t, w in zip(final.tensors(), w_final))
    wrt = [*args, *state_tensors]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return o, final, grads


def _initial_state(variant, B, T0, H, H_kv, D, seed):
    """The fp32 state after T0 earlier tokens (the reference's), as leaves with gradient."""
    past = [a.detach().float() for a in _qkv(B, T0, H, H_kv, D, torch.float32, seed,
                                              *_spread(variant))]
    fn = approx_attention_chunked if variant == "approx" else nonapprox_attention_chunked
    _, st = fn(*past)
    return [t.detach().clone().requires_grad_() for t in st.tensors()], T0


def _spread(variant):
    return (OFFSET, SPREAD) if variant == "approx" else (0.0, 1.0)


def _compare(variant, B, T0, T, H, H_kv, D, dtype=torch.float32, use_o=True, use_final=True,
             seed=5, max_shift=0.0):
    state, length0 = _initial_state(variant, B, T0, H, H_kv, D, seed)
    if max_shift:  # nonapprox: a state whose max is above every new score (its own gradient)
        state[2] = (state[2] + max_shift).detach().requires_grad_()
    args = _qkv(B, T, H, H_kv, D, dtype, seed + 1, *_spread(variant))
    g = torch.Generator().manual_seed(seed + 2)
    w_o = torch.randn(B, T, H, D, generator=g).to(DEVICE)
    w_final = _weights(state, seed + 3)
    o, final, got = _run(variant, args, state, length0, use_o, use_final, "kernel", w_o, w_final)
    ref_args = [a.detach().float().requires_grad_() for a in args]
    ref_state = [t.detach().clone().requires_grad_() for t in state]
    ref_o, ref_final, ref = _run(variant, ref_args, ref_state, length0, use_o, use_final,
                                 "reference", w_o, w_final)
    names = ["dq", "dk", "dv"] + [f"d_{n}" for n in _state_names(variant)]
    bound = BOUNDS[dtype]
    errors = {"o": rel_rms(o.float(), ref_o)}
    for name, a, b in zip(_state_names(variant), final.tensors(), ref_final.tensors()):
        errors[name] = rel_rms(a, b)
    for name, x, r, t in zip(names, got, ref, [*args, *state]):
        assert x is not None, name
        r = torch.zeros_like(t, dtype=torch.float32) if r is None else r  # unused by the loss
        if r.abs().max() == 0:  # zero by the math (q without o in the loss): held to the bound
            errors[name] = x.abs().max().item()
            continue
        assert torch.isfinite(x).all(), name
        errors[name] = rel_rms(x.float(), r.float())
    for name, x in zip(names[3:], got[3:]):
        assert x.dtype == torch.float32, name
    print({k: f"{v:.1e}" for k, v in errors.items()})
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"relative RMS above {bound}: {bad}"


def _state_names(variant):
    if variant == "approx":
        return ("sum_v", "sum_k1", "sum_k2", "kv1", "kv2")
    return ("num", "den", "max")


# ------------------------------------------------------------------------------------------
# approx
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scan", ["parallel", "sequential"])
def test_approx_state_gradients_fp32(scan, monkeypatch):
    """fp32, ragged (50 earlier tokens, 130 = 2 chunks + 2), GQA, padded D (24 in 32), several
    blocks of S (16 x 16): both scans start the reverse sums at the final state's gradient and
    return the initial state's."""
    monkeypatch.setenv(APPROX.function.LAUNCH_ENV, json.dumps(
        {"scan": scan, "BK_delta": 16, "BV_delta": 16, "BK_state": 16, "BV_state": 16}))
    _compare("approx", 2, 50, 130, 4, 2, 24)


def test_approx_only_the_final_state_has_a_gradient():
    """The loss reads only the final state: o gets no gradient (None into the backward)."""
    _compare("approx", 1, 30, 70, 4, 2, 16, use_o=False)


def test_approx_state_gradients_fp16():
    _compare("approx", 1, 40, 150, 4, 2, 32, dtype=torch.float16)


@pytest.mark.slow
def test_approx_state_gradients_without_final_state_use():
    """Only o in the loss (state passing's use): the initial state's gradient alone."""
    _compare("approx", 2, 20, 65, 4, 2, 16, use_final=False)


# ------------------------------------------------------------------------------------------
# nonapprox
# ------------------------------------------------------------------------------------------
def test_nonapprox_state_gradients_fp32():
    """fp32, ragged (50 earlier tokens, 130 = 2 chunks of 64 + 2), GQA, padded D (24 in 32):
    the final state's (num, den, max) gradients enter the reverse scan, the initial state's
    come back; the final max's own gradient goes to the maximum score."""
    _compare("nonapprox", 2, 50, 130, 4, 2, 24)


def test_nonapprox_state_max_above_the_scores():
    """The initial state's max above every new score: the final max is the initial one, and
    its gradient goes to max0 (32-token chunks: D = 80)."""
    _compare("nonapprox", 1, 20, 45, 4, 2, 80, max_shift=30.0)


def test_nonapprox_only_the_final_state_has_a_gradient():
    _compare("nonapprox", 1, 30, 70, 4, 2, 16, use_o=False)


def test_nonapprox_state_gradients_fp16():
    _compare("nonapprox", 1, 40, 150, 4, 2, 32, dtype=torch.float16)


@pytest.mark.slow
def test_nonapprox_state_gradients_without_final_state_use():
    """Only o in the loss (state passing's use): the initial state's gradient alone."""
    _compare("nonapprox", 2, 20, 65, 4, 2, 16, use_final=False)


@pytest.mark.parametrize("name", ["approx", "nonapprox"])
def test_no_state_path_unchanged(name):
    """Without a state the kernel's gradients are those of the call without a final state,
    bit for bit (the final state's unused outputs add nothing)."""
    spread = (OFFSET, SPREAD) if name == "approx" else ()
    args = _qkv(1, 70, 4, 2, 16, torch.float32, 3, *spread)
    d_o = torch.randn(1, 70, 4, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    o = getattr(ops, f"{name}_attention")(*args, impl="kernel")
    plain = torch.autograd.grad(o, args, d_o)
    o2, _ = getattr(ops, f"{name}_prefill")(*args, impl="kernel")
    with_final = torch.autograd.grad(o2, args, d_o)
    assert torch.equal(o, o2)
    for a, b in zip(plain, with_final):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# asa
# ------------------------------------------------------------------------------------------
ASA = kernel_package("asa")
ASA_MODES = ("linear", "mean", "none")


def _asa_run(args, state, normalize, impl, use_o, use_final, w_o, w_final, tokens_before):
    """o and the final state of ``ops.asa_prefill`` continuing from ``state``; the loss
    <o, w_o> (use_o) + <S_T, w_S> + <z_T, w_z> (use_final); its gradients w.r.t. q, k, v, p_q,
    p_k, S0 and z0."""
    o, final = ops.asa_prefill(*args, normalize=normalize, state=ops.ASAState(*state),
                               impl=impl, tokens_before=tokens_before)
    loss = 0.0
    if use_o:
        loss = loss + (o.float() * w_o).sum()
    if use_final:
        loss = loss + sum((t.float() * w).sum() for t, w in zip(final, w_final))
    return o, final, torch.autograd.grad(loss, [*args, *state], allow_unused=True)


def _compare_asa(normalize, B, T0, T, H, H_kv, D, m, dtype=torch.float32, use_o=True,
                 use_final=True, tokens_before=False, seed=5):
    """The kernel against the chunked reference's autograd: o, the final state, and the
    gradients of q, k, v, p_q, p_k and the initial state (S0, z0: the reference's state after
    T0 earlier tokens). "mean" counts the earlier tokens as Σ_m z0 (whose gradient z0 gets)
    or, with ``tokens_before``, as the host int T0."""
    g = torch.Generator().manual_seed(seed)
    p_q, p_k = ((torch.randn(H, D, m, generator=g) * D ** -0.5).to(DEVICE) for _ in range(2))
    past = [a.detach().float() for a in _qkv(B, T0, H, H_kv, D, torch.float32, seed + 1)]
    _, st = ops.asa.asa_attention_chunked(*past, p_q, p_k, normalize)
    state = [t.detach().clone().requires_grad_() for t in st]
    args = _qkv(B, T, H, H_kv, D, dtype, seed + 2)
    args += [p.to(device=DEVICE, dtype=dtype).requires_grad_() for p in (p_q, p_k)]
    w_o = torch.randn(B, T, H, D, generator=g).to(DEVICE)
    w_final = _weights(state, seed + 3)
    count = T0 if tokens_before else None
    o, final, got = _asa_run(args, state, normalize, "kernel", use_o, use_final, w_o, w_final,
                             count)
    ref_args = [a.detach().float().requires_grad_() for a in args]
    ref_state = [t.detach().clone().requires_grad_() for t in state]
    ref_o, ref_final, ref = _asa_run(ref_args, ref_state, normalize, "reference", use_o,
                                     use_final, w_o, w_final, count)
    names = ["dq", "dk", "dv", "dp_q", "dp_k", "d_S0", "d_z0"]
    errors = {"o": rel_rms(o.float(), ref_o), "S": rel_rms(final.S, ref_final.S),
              "z": rel_rms(final.z, ref_final.z)}
    for name, x, r, t in zip(names, got, ref, [*args, *state]):
        assert x is not None, name
        r = torch.zeros_like(t, dtype=torch.float32) if r is None else r  # unused by the loss
        if r.abs().max() == 0:  # zero by the math: held to the bound
            errors[name] = x.abs().max().item()
            continue
        assert torch.isfinite(x).all(), name
        errors[name] = rel_rms(x.float(), r.float())
    assert got[5].dtype == got[6].dtype == torch.float32
    print({k: f"{v:.1e}" for k, v in errors.items()})
    bound = BOUNDS[dtype]
    bad = {k: v for k, v in errors.items() if not v <= bound}
    assert not bad, f"relative RMS above {bound}: {bad}"


SLOW = pytest.mark.slow


@pytest.mark.parametrize("scan, normalize", [
    ("parallel", "linear"), ("parallel", "mean"), ("parallel", "none"),
    ("sequential", "none"), pytest.param("sequential", "linear", marks=SLOW),
    pytest.param("sequential", "mean", marks=SLOW)])
def test_asa_state_gradients_fp32(normalize, scan, monkeypatch):
    """fp32, ragged (40 earlier tokens, 70 = a 64-token chunk + 6), GQA (4 query heads on 2),
    padded D (24 in 32) and m (12 in 16), Dv in two 16-wide blocks of the state scans: the
    final state's gradient starts the reverse sums (z's too without the linear normalisation,
    "none" on the sequential scan), the initial state's comes back; "mean" counts the earlier
    tokens as Σ_m z0, whose gradient z0 gets."""
    monkeypatch.setenv(ASA.function.LAUNCH_ENV, json.dumps(
        {"scan": scan, "BV_state": 16, "BV_delta": 16}))
    _compare_asa(normalize, 1, 40, 70, 4, 2, 24, 12)


@pytest.mark.parametrize("normalize", [
    "linear", pytest.param("mean", marks=SLOW), pytest.param("none", marks=SLOW)])
def test_asa_state_gradients_fp16(normalize):
    _compare_asa(normalize, 1, 30, 100, 4, 2, 32, 16, dtype=torch.float16)


@pytest.mark.parametrize("normalize", ["none", pytest.param("linear", marks=SLOW)])
def test_asa_only_the_final_state_has_a_gradient(normalize):
    """The loss reads only the final state: o gets no gradient (None into the backward); the
    final z's gradient reaches the keys whatever the normalisation."""
    _compare_asa(normalize, 1, 20, 70, 4, 2, 16, 8, use_o=False)


@pytest.mark.parametrize("normalize", [
    "mean", pytest.param("linear", marks=SLOW), pytest.param("none", marks=SLOW)])
def test_asa_state_gradients_without_final_state_use(normalize):
    """Only o in the loss (state passing's use), "mean" counting the earlier tokens as a host
    int (no gradient into z0 through the count)."""
    _compare_asa(normalize, 2, 20, 65, 4, 2, 16, 8, use_final=False, tokens_before=True)


@pytest.mark.parametrize("scan, normalize", [
    ("parallel", "linear"), ("sequential", "mean"), pytest.param("parallel", "none", marks=SLOW),
    pytest.param("parallel", "mean", marks=SLOW), pytest.param("sequential", "linear", marks=SLOW),
    pytest.param("sequential", "none", marks=SLOW)])
def test_asa_no_state_path_unchanged(normalize, scan, monkeypatch):
    """Without a state the kernel's gradients are those of the call without a final state,
    bit for bit (the final state's unused outputs add nothing)."""
    monkeypatch.setenv(ASA.function.LAUNCH_ENV, json.dumps({"scan": scan}))
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(*shape, generator=g).to(DEVICE).requires_grad_()
            for shape in ((1, 70, 4, 16), (1, 70, 2, 16), (1, 70, 2, 16), (4, 16, 8), (4, 16, 8))]
    d_o = torch.randn(1, 70, 4, 16, generator=g).to(DEVICE)
    o = ops.asa_attention(*args, normalize=normalize, impl="kernel")
    plain = torch.autograd.grad(o, args, d_o)
    o2, _ = ops.asa_prefill(*args, normalize=normalize, impl="kernel")
    with_final = torch.autograd.grad(o2, args, d_o)
    assert torch.equal(o, o2)
    for a, b in zip(plain, with_final):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# GPU: the compiled kernels at the sizes training uses (not run by the CPU suite)
# ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("scan", ["parallel", "sequential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_approx_state_gradients_gpu(dtype, scan, monkeypatch):
    monkeypatch.setenv(APPROX.function.LAUNCH_ENV, json.dumps({"scan": scan}))
    _compare("approx", 2, 300, 1000, 8, 2, 128, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
def test_nonapprox_state_gradients_gpu(dtype, D):
    _compare("nonapprox", 2, 300, 1000, 8, 2, D, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("scan", ["parallel", "sequential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("normalize", ASA_MODES)
def test_asa_state_gradients_gpu(normalize, dtype, scan, monkeypatch):
    monkeypatch.setenv(ASA.function.LAUNCH_ENV, json.dumps({"scan": scan}))
    _compare_asa(normalize, 2, 300, 1000, 8, 2, 128, 64, dtype=dtype)
