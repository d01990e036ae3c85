"""asa: the op against its definition, decode, bad input, config, the module, checkpoints, training.

TP=2 / SP / PP equivalence of the module is in tests/test_parallel_equivalence.py (VARIANT_CASES).
"""

import os

import pytest
import torch

import megatron_subq as subq
from megatron_subq import ops
from megatron_subq.config import ASA_NORMALIZE_MODES as CONFIG_MODES
from megatron_subq.ops.asa import (
    ASA_NORMALIZE_MODES,
    asa_attention_chunked,
    asa_attention_quadratic,
    asa_empty_state,
)
from megatron_subq.testing import run_distributed
from megatron_subq.testing.checkpoint import assert_resharded, reshard_tp2_tp1_tp2

MODES = ASA_NORMALIZE_MODES


def _inputs(B=2, T=13, H=4, H_kv=2, D=8, m=5, Dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, H_kv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T, H_kv, Dv, generator=g, dtype=dtype)
    # a wider P than the module's init, so the feature softmaxes are far from uniform
    p_q = torch.randn(H, D, m, generator=g, dtype=dtype)
    p_k = torch.randn(H, D, m, generator=g, dtype=dtype)
    return q, k, v, p_q, p_k


def _definition_by_loops(q, k, v, p_q, p_k, normalize):
    """variants.md written out one (b, h, i, j) at a time, in float64."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    out = torch.zeros(B, T, H, v.shape[3], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv_head = h // group  # megatron's GQA: query heads of a group are contiguous
            for i in range(T):
                q_feat = torch.softmax(q[b, i, h].double() @ p_q[h].double(), dim=0)
                acc, weight_sum = 0.0, 0.0
                for j in range(i + 1):
                    k_feat = torch.softmax(k[b, j, kv_head].double() @ p_k[h].double(), dim=0)
                    w = torch.dot(q_feat, k_feat)
                    acc = acc + w * v[b, j, kv_head].double()
                    weight_sum = weight_sum + w
                norm = {"linear": weight_sum, "none": 1.0, "mean": i + 1.0}[normalize]
                out[b, i, h] = acc / norm
    return out


def test_modes_agree_with_config():
    assert tuple(MODES) == tuple(CONFIG_MODES)


@pytest.mark.parametrize("normalize", MODES)
def test_quadratic_form_is_the_definition(normalize):
    args = _inputs(B=1, T=6, H=4, H_kv=2, D=4, m=3)
    got = asa_attention_quadratic(*args, normalize=normalize)
    torch.testing.assert_close(got.double(), _definition_by_loops(*args, normalize),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalize", MODES)
@pytest.mark.parametrize("T,H,H_kv,chunk", [(1, 2, 2, 4), (13, 4, 2, 4), (16, 4, 1, 4),
                                            (70, 2, 2, 64), (9, 3, 3, 1)])
def test_chunked_equals_quadratic(normalize, T, H, H_kv, chunk):
    args = _inputs(T=T, H=H, H_kv=H_kv, Dv=6)
    got, state = asa_attention_chunked(*args, normalize=normalize, chunk_size=chunk)
    ref = asa_attention_quadratic(*args, normalize=normalize)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # Σ_m z counts the tokens (every k' is a probability vector)
    torch.testing.assert_close(state.z.sum(-1), torch.full((2, H), float(T), dtype=torch.float64))


@pytest.mark.parametrize("normalize", MODES)
def test_op_reference_and_output_properties(normalize):
    q, k, v, p_q, p_k = _inputs(T=20, dtype=torch.float32)
    out = ops.asa_attention(q, k, v, p_q, p_k, normalize=normalize)  # CPU: the reference
    ref = ops.asa_attention(q, k, v, p_q, p_k, normalize=normalize, impl="reference")
    torch.testing.assert_close(out, ref)
    assert out.shape == q.shape and out.dtype == q.dtype
    # causal: changing the last token changes nothing before it
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 1.0
    v2[:, -1] -= 2.0
    out2 = ops.asa_attention(q, k2, v2, p_q, p_k, normalize=normalize)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])
    assert not torch.allclose(out2[:, -1], out[:, -1])


def test_linear_normalisation_is_a_weighted_average():
    q, k, v, p_q, p_k = _inputs(T=11)
    ones = torch.ones_like(v)
    torch.testing.assert_close(ops.asa_attention(q, k, ones, p_q, p_k),
                               torch.ones(2, 11, 4, 8, dtype=torch.float64))
    # 'none' grows with i: the sum of q'_i·k'_j over j <= i, at most i+1 and at least 0
    grow = ops.asa_attention(q, k, ones, p_q, p_k, normalize="none")[..., 0]
    steps = torch.arange(1, 12, dtype=torch.float64)[None, :, None]
    assert (grow > 0).all() and (grow <= steps + 1e-9).all()
    # 'mean' is 'none' divided by i+1
    none = ops.asa_attention(q, k, v, p_q, p_k, normalize="none")
    torch.testing.assert_close(ops.asa_attention(q, k, v, p_q, p_k, normalize="mean"),
                               none / steps[..., None])


@pytest.mark.parametrize("normalize", MODES)
def test_decode_token_by_token_equals_full_forward(normalize):
    q, k, v, p_q, p_k = _inputs(T=12, H=4, H_kv=2, Dv=6, dtype=torch.float32)
    full = ops.asa_attention(q, k, v, p_q, p_k, normalize=normalize)
    # 1) pure decode from an empty state
    state = asa_empty_state(2, 4, p_q.shape[2], 6)
    steps = [ops.asa_decode_step(q[:, t], k[:, t], v[:, t], p_q, p_k, state, normalize)
             for t in range(12)]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    # 2) chunked prefill of 5 tokens, then 3, then decode the rest: same rows, same final state
    o1, st = ops.asa_prefill(q[:, :5], k[:, :5], v[:, :5], p_q, p_k, normalize)
    o2, st = ops.asa_prefill(q[:, 5:8], k[:, 5:8], v[:, 5:8], p_q, p_k, normalize, state=st)
    rest = [ops.asa_decode_step(q[:, t], k[:, t], v[:, t], p_q, p_k, st, normalize)
            for t in range(8, 12)]
    got = torch.cat([o1, o2, torch.stack(rest, dim=1)], dim=1)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.S, state.S, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.z, state.z, rtol=1e-5, atol=1e-5)


def test_reference_gradients():
    """Gradients reach q, k, v, P_Q and P_K (float64 gradcheck of the chunked reference)."""
    args = [t.requires_grad_() for t in _inputs(B=1, T=5, H=2, H_kv=1, D=3, m=2)]
    for normalize in MODES:
        assert torch.autograd.gradcheck(
            lambda *a: asa_attention_chunked(*a, normalize=normalize, chunk_size=2)[0], args,
            fast_mode=True)


@pytest.mark.parametrize("bad,needle", [
    (dict(p_q=torch.randn(4, 8)), "p_q must have shape"),
    (dict(p_q=torch.randn(3, 8, 5)), "p_q must have shape"),
    (dict(p_k=torch.randn(4, 7, 5)), "p_k must have shape"),
    (dict(p_k=torch.randn(4, 8, 6)), "p_q and p_k must have the same shape"),
    (dict(p_k=torch.randn(4, 8, 5, dtype=torch.float64)), "p_q and p_k must share a dtype"),
    (dict(p_q=torch.randint(0, 2, (4, 8, 5))), "p_q must be a floating-point"),
    (dict(normalize="l2"), "normalize='l2'"),
    (dict(impl="fast"), "impl='fast'"),
    (dict(k=torch.randn(2, 13, 3, 8), v=torch.randn(2, 13, 3, 8)),
     "multiple of the key/value head count"),
    (dict(v=torch.randn(2, 12, 2, 8)), "must share \\[B, T\\]"),
])
def test_bad_arguments_name_the_argument(bad, needle):
    q, k, v, p_q, p_k = _inputs(dtype=torch.float32)
    kwargs = {**dict(q=q, k=k, v=v, p_q=p_q, p_k=p_k), **bad}
    with pytest.raises(ValueError, match=needle):
        ops.asa_attention(**kwargs)


def test_bad_state_and_decode_arguments():
    q, k, v, p_q, p_k = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="state must be S"):
        ops.asa_prefill(q, k, v, p_q, p_k, state=asa_empty_state(2, 4, 4, 8))
    with pytest.raises(ValueError, match="float32"):
        S, z = asa_empty_state(2, 4, 5, 8)
        ops.asa_prefill(q, k, v, p_q, p_k, state=(S.double(), z))
    with pytest.raises(ValueError, match="one token"):
        ops.asa_decode_step(q, k[:, 0], v[:, 0], p_q, p_k, asa_empty_state(2, 4, 5, 8))
    with pytest.raises(ValueError, match="chunk_size"):
        asa_attention_chunked(q, k, v, p_q, p_k, chunk_size=0)
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        # (under the interpreter, CPU tensors are valid kernel inputs)
        with pytest.raises(ValueError, match="impl='kernel' needs CUDA tensors|no kernel"):
            ops.asa_attention(q, k, v, p_q, p_k, impl="kernel")


# ------------------------------------------------------------------------------------------
# packed variable-length sequences (cu_seqlens)
# ------------------------------------------------------------------------------------------
# sequence lengths 1, 0 (empty), 6, 1, 5 (chunk-crossing sequences: tests/test_asa_kernel.py)
PACKED_BOUNDS = [0, 1, 1, 7, 8, 13]


@pytest.mark.parametrize("normalize", MODES)
def test_packed_sequences_equal_separate_runs(normalize):
    """Packed (B = 1, cu_seqlens) == every sequence run alone (the O(T²) form), concatenated:
    outputs and all five gradients — no state or "mean" count leaks across a boundary."""
    args = [t.requires_grad_() for t in _inputs(B=1, T=PACKED_BOUNDS[-1], H=4, H_kv=2)]
    cu_seqlens = torch.tensor(PACKED_BOUNDS, dtype=torch.int32)
    packed = ops.asa_attention(*args, normalize=normalize, impl="reference",
                               cu_seqlens=cu_seqlens)
    q, k, v, p_q, p_k = args
    separate = torch.cat([asa_attention_quadratic(q[:, a:b], k[:, a:b], v[:, a:b], p_q, p_k,
                                                  normalize)
                          for a, b in zip(PACKED_BOUNDS, PACKED_BOUNDS[1:]) if b > a], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-10, atol=1e-10)
    d_out = torch.randn(packed.shape, dtype=packed.dtype,
                        generator=torch.Generator().manual_seed(3))
    for got, want in zip(torch.autograd.grad(packed, args, d_out),
                         torch.autograd.grad(separate, args, d_out)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # and packing matters: the unpacked run differs from the second sequence on
    whole = ops.asa_attention(*args, normalize=normalize, impl="reference")
    torch.testing.assert_close(whole[:, :1], packed[:, :1])
    assert not torch.allclose(whole[:, 1:], packed[:, 1:])


def test_single_packed_sequence_is_the_plain_op():
    args = _inputs(B=1, T=13)
    for dtype in (torch.int32, torch.int64):
        torch.testing.assert_close(
            ops.asa_attention(*args, cu_seqlens=torch.tensor([0, 13], dtype=dtype)),
            ops.asa_attention(*args))


@pytest.mark.parametrize("cu_seqlens,needle", [
    ([0, 5, 13], "B = 1"),  # with the B = 2 inputs below
    (torch.tensor([0.0, 13.0]), "1-D int32/int64"),
    (torch.tensor([[0, 13]]), "1-D int32/int64"),
    (torch.tensor([13]), "1-D int32/int64"),
    (torch.tensor([1, 13]), "start at 0"),
    (torch.tensor([0, 12]), "end at T=13"),
    (torch.tensor([0, 8, 5, 13]), "never decrease"),
])
def test_bad_cu_seqlens_name_the_argument(cu_seqlens, needle):
    B = 2 if isinstance(cu_seqlens, list) else 1
    if isinstance(cu_seqlens, list):
        cu_seqlens = torch.tensor(cu_seqlens)
    with pytest.raises(ValueError, match=needle) as err:
        ops.asa_attention(*_inputs(B=B, T=13, dtype=torch.float32), cu_seqlens=cu_seqlens)
    assert "cu_seqlens" in str(err.value)


# ------------------------------------------------------------------------------------------
# config and module
# ------------------------------------------------------------------------------------------
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            attention_variant="asa")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(asa_rank=16), "asa_rank=16"),          # == kv_channels (64 / 4)
    (dict(asa_rank=40), "asa_rank=40"),
    (dict(asa_rank=0), "asa_rank=0"),
    (dict(asa_rank=2.5), "asa_rank=2.5"),
    (dict(asa_normalize="softmax"), "asa_normalize='softmax'"),
    (dict(softmax_scale=0.5), "softmax_scale=0.5"),
])
def test_config_rejects_bad_asa_knobs(kwargs, needle):
    with pytest.raises(ValueError) as err:
        subq.SubqTransformerConfig(**{**BASE, **kwargs})
    assert needle in str(err.value) and "allowed" in str(err.value)


def test_config_default_rank_fits_the_head():
    assert subq.SubqTransformerConfig(**BASE).asa_rank == 8  # min(64, 16 // 2)
    assert subq.SubqTransformerConfig(**{**BASE, "kv_channels": 128}).asa_rank == 64
    assert subq.SubqTransformerConfig(**{**BASE, "kv_channels": 256}).asa_rank == 64
    assert subq.SubqTransformerConfig(**{**BASE, "asa_rank": 15}).asa_rank == 15


def test_module_matches_op():
    """The core attention outside any parallel state: [s, b, h, d] in, the op's output out."""
    from megatron_subq.variants.asa import ASACoreAttention

    cfg = subq.SubqTransformerConfig(**BASE, asa_rank=6, asa_normalize="none")
    torch.manual_seed(0)
    core = ASACoreAttention(cfg, layer_number=1)
    assert core.p_q.shape == core.p_k.shape == (4, 16, 6)
    assert getattr(core.p_q, "tensor_model_parallel") and core.p_q.partition_dim == 0
    # fan-in init: std 1/sqrt(D)
    assert 0.15 < core.p_q.std().item() < 0.35
    s, b = 7, 2
    q = torch.randn(s, b, 4, 16)
    k = torch.randn(s, b, 2, 16)
    v = torch.randn(s, b, 2, 16)
    out = core(q, k, v, attention_mask=None)
    ref = ops.asa_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), core.p_q,
                            core.p_k, normalize="none").transpose(0, 1).reshape(s, b, 64)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert core.p_q.grad is not None and core.p_q.grad.abs().sum() > 0
    assert core.p_k.grad is not None and core.p_k.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------
# checkpoints (TP=2 -> TP=1 -> TP=2) and training, in one spawned world each
# ------------------------------------------------------------------------------------------
def test_dist_checkpoint_reshards_tp2_tp1_tp2(tmp_path):
    """P_Q/P_K (and everything else) are declared with the right sharding."""
    assert_resharded(run_distributed(reshard_tp2_tp1_tp2, 2, tp=2, args=(
        {"attention_variant": "asa", "asa_rank": 8}, str(tmp_path))))


def train_tiny_asa(steps: int, normalize: str) -> list:
    """A tiny asa GPT trained with Adam on a fixed batch of a learnable sequence; the losses."""
    from megatron_subq.testing.equivalence import TINY, fit_repeating_batch

    cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": "asa",
                                        "asa_normalize": normalize})
    return fit_repeating_batch(subq.build_gpt_model(cfg, vocab_size=64, max_sequence_length=32),
                               steps)


def test_tiny_gpt_trains_with_falling_loss():
    losses = run_distributed(train_tiny_asa, 1, tp=1, args=(40, "linear"))[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.6 * losses[0], losses
