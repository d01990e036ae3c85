"""sas: the op against its definition, identity reduction, parameter count, config, the module
(TP=2 with kernel 3 / GQA / biases, checkpoints across TP sizes), training.

The plain TP=2 / SP / PP equivalence of the default case is in tests/test_parallel_equivalence.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import megatron_subq as subq
from megatron_subq import ops
from megatron_subq.ops.sas import SASBranchWeights, head_conv, sas_simulated_attention
from megatron_subq.testing import run_distributed
from megatron_subq.testing.checkpoint import assert_resharded

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_variant="sas")


# ------------------------------------------------------------------------------------------
# the definition, written out independently of ops/sas.py (float64)
# ------------------------------------------------------------------------------------------
def _conv_by_taps(x, w, b=None):
    """out[.., o, d] = sum_c sum_j w[o, c, j] x[.., c, d + j - k//2] (zero padding)."""
    k = w.shape[-1]
    D = x.shape[-1]
    xp = F.pad(x, (k // 2, k // 2))
    out = sum(torch.einsum("oc,btcd->btod", w[:, :, j], xp[..., j:j + D]) for j in range(k))
    return out if b is None else out + b[:, None]


def _branch_by_definition(x, w: SASBranchWeights):
    y = _conv_by_taps(x, w.conv_in, w.conv_in_bias)
    y = y + _conv_by_taps(torch.relu(y), w.conv_res, w.conv_res_bias)  # RCNN
    if w.lin is None:
        return y
    z = y @ w.lin.T + (0 if w.lin_bias is None else w.lin_bias)
    return z + torch.relu(z) @ w.lin_res.T + (0 if w.lin_res_bias is None else w.lin_res_bias)


def _sas_by_definition(q, k, v, wq, wk, wv):
    B, T, H, D = q.shape
    group = H // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    qh, kh, vh = _branch_by_definition(q, wq), _branch_by_definition(k, wk), \
        _branch_by_definition(v, wv)
    n_sim = qh.shape[2]
    heads = torch.empty(B, T, n_sim, D, dtype=q.dtype)
    for j in range(n_sim):
        for i in range(T):
            s = torch.einsum("bd,bjd->bj", qh[:, i, j], kh[:, :i + 1, j]) / math.sqrt(qh.shape[-1])
            heads[:, i, j] = torch.einsum("bj,bjd->bd", s.softmax(-1), vh[:, :i + 1, j])
    out = torch.zeros(B, T, H, D, dtype=q.dtype)
    for g in range(n_sim // H):  # PEAA: head g*H + h averages into h
        out += heads[:, :, g * H:(g + 1) * H] / (n_sim // H)
    return out


def _weights(H, H_sim, D, D_sim, kernel, bias, features, g, dtype=torch.float64, scale=0.4):
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype) * scale  # noqa: E731
    return SASBranchWeights(
        conv_in=r(H_sim, H, kernel), conv_res=r(H_sim, H_sim, kernel),
        lin=r(D_sim, D) if features else None, lin_res=r(D_sim, D_sim) if features else None,
        conv_in_bias=r(H_sim) if bias else None, conv_res_bias=r(H_sim) if bias else None,
        lin_bias=r(D_sim) if (bias and features) else None,
        lin_res_bias=r(D_sim) if (bias and features) else None)


def _case(B=2, T=9, H=4, H_kv=2, D=8, H_sim=8, D_sim=12, kernel=3, bias=True, seed=0,
          dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, T, H_kv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T, H_kv, D, generator=g, dtype=dtype)
    ws = [_weights(H, H_sim, D, D_sim, kernel, bias, f, g, dtype) for f in (True, True, False)]
    return (q, k, v), ws


# ------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------
def test_head_conv_is_a_conv_over_heads_along_features():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 10, generator=g, dtype=torch.float64)
    for kernel in (1, 3, 5):
        w = torch.randn(6, 4, kernel, generator=g, dtype=torch.float64)
        b = torch.randn(6, generator=g, dtype=torch.float64)
        torch.testing.assert_close(head_conv(x, w, b), _conv_by_taps(x, w, b))
    # kernel 1 is a linear map across heads at every feature position
    w = torch.randn(6, 4, 1, generator=g, dtype=torch.float64)
    torch.testing.assert_close(head_conv(x, w), torch.einsum("oc,btcd->btod", w[..., 0], x))


@pytest.mark.parametrize("H_kv,kernel,bias", [(4, 1, False), (2, 3, True), (1, 5, False)])
def test_op_equals_the_definition(H_kv, kernel, bias):
    (q, k, v), (wq, wk, wv) = _case(H_kv=H_kv, kernel=kernel, bias=bias, seed=kernel)
    ref = _sas_by_definition(q, k, v, wq, wk, wv)
    for impl in ("reference", None, "kernel"):
        out = ops.sas_attention(q, k, v, wq, wk, wv, impl=impl)
        assert out.shape == q.shape and out.dtype == q.dtype
        # standard_attention's reference computes the softmax attention in float32
        tol = dict(rtol=1e-5, atol=1e-6) if impl == "reference" else dict(rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"impl={impl}: {m}")


def test_op_is_causal_and_differentiable():
    (q, k, v), ws = _case(dtype=torch.float32)
    for t in (q, k, v, *[w.conv_in for w in ws], ws[0].lin_res):
        t.requires_grad_(True)
    out = ops.sas_attention(q, k, v, *ws)
    k2 = k.detach().clone()
    k2[:, -1] += 1.0
    out2 = ops.sas_attention(q, k2, v, *ws)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])
    assert not torch.allclose(out2[:, -1], out[:, -1])
    out.square().sum().backward()
    for t in (q, k, v, *[w.conv_in for w in ws], ws[0].lin_res):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_a_subset_of_simulated_heads_is_a_slice_of_all_of_them():
    """What each TP rank computes: its simulated heads, from every input head."""
    (q, k, v), ws = _case()
    full = sas_simulated_attention(q, k, v, *ws)
    heads = [5, 1, 6, 2]  # any order, the rows of conv_res given for them
    sub = [SASBranchWeights(**{**w.__dict__, "conv_res": w.conv_res[heads],
                               "conv_res_bias": w.conv_res_bias[heads]}) for w in ws]
    torch.testing.assert_close(sas_simulated_attention(q, k, v, *sub, heads=heads),
                               full[:, :, heads])


def _identity_weights(H, D, kernel, features, dtype=torch.float64):
    conv_in = torch.zeros(H, H, kernel, dtype=dtype)
    conv_in[:, :, kernel // 2] = torch.eye(H, dtype=dtype)  # centre tap: identity
    return SASBranchWeights(
        conv_in=conv_in, conv_res=torch.zeros(H, H, kernel, dtype=dtype),
        lin=torch.eye(D, dtype=dtype) if features else None,
        lin_res=torch.zeros(D, D, dtype=dtype) if features else None)


@pytest.mark.parametrize("kernel,H_kv", [(1, 4), (3, 2)])
def test_identity_expansion_is_standard_attention(kernel, H_kv):
    (q, k, v), _ = _case(H_kv=H_kv)
    ws = [_identity_weights(4, 8, kernel, f) for f in (True, True, False)]
    torch.testing.assert_close(ops.sas_attention(q, k, v, *ws), ops.standard_attention(q, k, v),
                               rtol=1e-12, atol=1e-12)


def test_peaa_averages_groups_of_heads():
    o = torch.arange(2 * 6, dtype=torch.float64).view(1, 1, 6, 2)  # 6 simulated, H=3
    out = ops.peaa(o, 3)
    torch.testing.assert_close(out[0, 0, 1], (o[0, 0, 1] + o[0, 0, 4]) / 2)
    with pytest.raises(ValueError, match="num_heads=4"):
        ops.peaa(o, 4)


def _replace(w, **kw):
    return SASBranchWeights(**{**w.__dict__, **kw})


@pytest.mark.parametrize("mutate,needle", [
    (lambda q, k, v, ws: ((q, k[..., :4], v), ws), "q and k must have the same head dim"),
    (lambda q, k, v, ws: ((q, k, v), [_replace(ws[0], conv_in=ws[0].conv_in[:, :, :2]), *ws[1:]]),
     "wq.conv_in has kernel size 2"),
    (lambda q, k, v, ws: ((q, k, v), [_replace(ws[0], conv_in=ws[0].conv_in[:, :3]), *ws[1:]]),
     "wq.conv_in must have shape"),
    (lambda q, k, v, ws: ((q, k, v), [ws[0], _replace(ws[1], conv_res=ws[1].conv_res[:4]), ws[2]]),
     "wk.conv_res must have shape"),
    (lambda q, k, v, ws: ((q, k, v), [ws[0], _replace(ws[1], lin=ws[1].lin[:10]), ws[2]]),
     "wk.lin_res must have shape"),
    (lambda q, k, v, ws: ((q, k, v), [ws[0], ws[1], _replace(ws[2], lin=ws[0].lin)]),
     "wv.lin and wv.lin_res must be None"),
    (lambda q, k, v, ws: ((q, k, v), [_replace(ws[0], lin=None), *ws[1:]]), "wq.lin must have"),
    (lambda q, k, v, ws: ((q, k, v), [_replace(ws[0], conv_in_bias=ws[0].conv_in_bias[:3]),
                                      *ws[1:]]), "wq.conv_in_bias must have shape"),
    (lambda q, k, v, ws: ((q, k, v), [_replace(ws[0], conv_in=ws[0].conv_in.float()), *ws[1:]]),
     "wq.conv_in is torch.float32"),
    (lambda q, k, v, ws: ((q, k, v), [ws[0], ws[1], _weights(4, 12, 8, 12, 3, False, False,
                                                             torch.Generator())]),
     "wv.conv_in has 12 simulated heads"),
])
def test_bad_arguments_name_the_argument(mutate, needle):
    (q, k, v), ws = _case()
    (q, k, v), ws = mutate(q, k, v, ws)
    with pytest.raises(ValueError) as err:
        ops.sas_attention(q, k, v, *ws)
    assert needle in str(err.value), str(err.value)


def test_bad_impl_and_head_multiple():
    (q, k, v), ws = _case()
    with pytest.raises(ValueError, match="impl="):
        ops.sas_attention(q, k, v, *ws, impl="fast")
    (q, k, v), ws = _case(H_sim=6, bias=False)
    with pytest.raises(ValueError, match="not a multiple of the 4 query heads"):
        ops.sas_attention(q, k, v, *ws)


# ------------------------------------------------------------------------------------------
# config and parameters
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,needle", [
    ({"sas_heads": 6}, "sas_heads=6"),
    ({"sas_heads": 2}, "sas_heads=2"),
    ({"sas_head_dim": 0}, "sas_head_dim=0"),
    ({"sas_kernel": 2}, "sas_kernel=2"),
    ({"sas_kernel": 0}, "sas_kernel=0"),
    ({"context_parallel_size": 2}, "context_parallel_size=2"),
])
def test_config_rejects_bad_sas_knobs(kwargs, needle):
    with pytest.raises(ValueError) as err:
        subq.SubqTransformerConfig(**BASE, **kwargs)
    assert needle in str(err.value) and "allowed" in str(err.value), str(err.value)


def test_config_defaults():
    cfg = subq.SubqTransformerConfig(**BASE)  # H=4, D=16
    assert (cfg.sas_heads, cfg.sas_head_dim, cfg.sas_kernel) == (12, 24, 1)


def _sas_weight_counts(**overrides):
    from megatron_subq.variants.sas import SASCoreAttention

    cfg = subq.SubqTransformerConfig(**{
        "num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "sas_heads": 36,
        "sas_head_dim": 96, "sas_kernel": 1, "attention_variant": "sas", **overrides})
    weights = biases = 0
    for layer in range(1, cfg.num_layers + 1):
        for name, p in SASCoreAttention(cfg, layer).named_parameters():
            if name.endswith("bias"):
                biases += p.numel()
            else:
                weights += p.numel()
    return weights, biases


def test_125m_config_adds_430848_weights():
    """The paper's count: 12 layers x (q, k: 432 + 1296 + 6144 + 9216; v: 432 + 1296)."""
    assert _sas_weight_counts() == (430_848, 0)
    # with the paper's nn.Conv1d / nn.Linear biases the weight count is unchanged
    assert _sas_weight_counts(add_bias_linear=True) == (430_848, 12 * (2 * (36 + 36 + 96 + 96)
                                                                      + 36 + 36))


# ------------------------------------------------------------------------------------------
# the module outside any parallel state (TP=1)
# ------------------------------------------------------------------------------------------
def _core(**kw):
    from megatron_subq.variants.sas import SASCoreAttention

    cfg = subq.SubqTransformerConfig(**{**BASE, "num_query_groups": 2, "sas_heads": 8,
                                        "sas_head_dim": 24, **kw})
    torch.manual_seed(0)
    return SASCoreAttention(cfg, layer_number=1)


@pytest.mark.parametrize("kernel,bias", [(1, False), (3, True)])
def test_module_matches_op(kernel, bias):
    core = _core(sas_kernel=kernel, add_bias_linear=bias)
    assert core.q_expansion.conv_res.shape == (4, 2, 8, kernel)  # [H, Ĥ/H, Ĥ, k]
    assert core.q_expansion.conv_res.tensor_model_parallel
    assert not getattr(core.q_expansion.conv_in, "tensor_model_parallel", False)
    assert core.v_expansion.lin is None
    s, b = 7, 2
    q = torch.randn(s, b, 4, 16)
    k, v = torch.randn(s, b, 2, 16), torch.randn(s, b, 2, 16)
    out = core(q, k, v, attention_mask=None)
    ref = ops.sas_attention(*(x.transpose(0, 1) for x in (q, k, v)),
                            core.q_expansion.paper_weights(), core.k_expansion.paper_weights(),
                            core.v_expansion.paper_weights())
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(s, b, 64))
    out.square().sum().backward()
    for name, p in core.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_module_with_identity_expansion_is_the_standard_core():
    from megatron_subq.variants.standard import SDPACoreAttention

    core = _core(sas_heads=4, sas_head_dim=16, sas_kernel=3)
    with torch.no_grad():
        for e in (core.q_expansion, core.k_expansion, core.v_expansion):
            e.conv_in.zero_()
            e.conv_in[:, :, 1] = torch.eye(4)
            e.conv_res.zero_()
            if e.lin is not None:
                e.lin.copy_(torch.eye(16))
                e.lin_res.zero_()
    standard = SDPACoreAttention(core.config, layer_number=1)
    q = torch.randn(6, 2, 4, 16)
    k, v = torch.randn(6, 2, 2, 16), torch.randn(6, 2, 2, 16)
    torch.testing.assert_close(core(q, k, v, None), standard(q, k, v, None))


# ------------------------------------------------------------------------------------------
# in spawned worlds: TP=2 (kernel 3, one KV head, biases) and checkpoints; GPT-level checks
# ------------------------------------------------------------------------------------------
TP_CASE = {"attention_variant": "sas", "sas_heads": 12, "sas_head_dim": 24, "sas_kernel": 3,
           "num_query_groups": 1, "add_bias_linear": True}


def _reinit(tp: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def explicit_tp_group_core() -> dict:
    """Under a global TP=1, a core handed a 2-rank ``pg_collection.tp`` shards its weights and
    gathers its heads over that group: each rank computes its heads of the TP=1 core's output."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_subq.variants.sas import SASCoreAttention

    cfg = subq.SubqTransformerConfig(**{**BASE, "num_query_groups": 2, "sas_heads": 8,
                                        "sas_head_dim": 24, "sas_kernel": 3})
    groups = ProcessGroupCollection(tp=torch.distributed.group.WORLD,
                                    cp=parallel_state.get_context_parallel_group())
    torch.manual_seed(0)
    full = SASCoreAttention(cfg, layer_number=1)  # the global groups: TP=1
    torch.manual_seed(0)
    part = SASCoreAttention(cfg, layer_number=1, pg_collection=groups)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, h, 16, generator=g) for h in (4, 2, 2))
    r = torch.distributed.get_rank()
    with torch.no_grad():
        ref = full(q, k, v, None)[..., 32 * r:32 * (r + 1)]
        got = part(q[:, :, 2 * r:2 * r + 2], k[:, :, r:r + 1], v[:, :, r:r + 1], None)
    return {"ref": ref, "got": got, "local_heads": part.num_heads_local,
            "conv_res": tuple(part.q_expansion.conv_res.shape)}


def two_rank_world(ckpt_dir: str) -> dict:
    """One 2-rank world: TP=1 (DP=2), TP=2 and TP=2+SP steps of TP_CASE, then checkpoints
    saved at TP=2 / loaded at TP=1 and saved at TP=1 / loaded at TP=2; and a core on explicit
    process groups."""
    from megatron_subq.testing.checkpoint import reshard_tp2_tp1_tp2
    from megatron_subq.testing.equivalence import tiny_gpt_step

    out = {}
    _reinit(1)
    out["tp1"] = tiny_gpt_step(TP_CASE)
    _reinit(2)
    out["tp2"] = tiny_gpt_step(TP_CASE)
    _reinit(2)
    out["tp2_sp"] = tiny_gpt_step({**TP_CASE, "sequence_parallel": True})
    ckpt = {"attention_variant": "sas", "sas_heads": 8, "sas_head_dim": 24, "sas_kernel": 3}
    out["resharded"] = reshard_tp2_tp1_tp2(ckpt, ckpt_dir)
    _reinit(1)
    out["explicit_groups"] = explicit_tp_group_core()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_distributed(two_rank_world, 2, tp=2,
                           args=(str(tmp_path_factory.mktemp("sas_ckpt")),))


@pytest.mark.parametrize("mode", ["tp2", "tp2_sp"])
def test_tp2_equals_tp1_kernel3_one_kv_head_biases(two_ranks, mode):
    for rank, res in enumerate(two_ranks):
        ref, got = res["tp1"], res[mode]
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-4, atol=1e-5)
        assert set(got["grads"]) == set(ref["grads"])
        sas_params = [n for n in ref["grads"] if "expansion" in n]
        # 2 layers x (q, k: 4 weights + 4 biases; v: 2 + 2)
        assert len(sas_params) == 2 * (8 + 8 + 4)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {mode} grad of {name}: {m}")


def test_checkpoint_reshards_tp2_tp1_tp2(two_ranks):
    assert_resharded([res["resharded"] for res in two_ranks])


def test_core_uses_the_process_groups_it_is_given(two_ranks):
    for res in two_ranks:
        r = res["explicit_groups"]
        assert r["local_heads"] == 2 and r["conv_res"] == (2, 2, 8, 3)  # half of H=4 heads
        torch.testing.assert_close(r["got"], r["ref"], rtol=1e-5, atol=1e-6)


def one_rank_world(steps: int) -> dict:
    """TP=1: (a) a sas GPT with identity expansions equals the standard GPT with the same other
    weights, and adds exactly the cores' parameters; (b) a tiny sas GPT trains."""
    from megatron_subq.testing.equivalence import TINY, fit_repeating_batch, make_batch

    out = {}
    cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": "sas", "sas_heads": 4,
                                        "sas_head_dim": 16, "sas_kernel": 3})
    sas = subq.build_gpt_model(cfg, vocab_size=64, max_sequence_length=16)
    with torch.no_grad():
        for name, p in sas.named_parameters():
            if ".conv_in" in name:
                p.zero_()
                p[:, :, 1] = torch.eye(4)
            elif ".conv_res" in name or ".lin_res" in name:
                p.zero_()
            elif name.endswith(".lin"):
                p.copy_(torch.eye(16))
    std = subq.build_gpt_model(subq.SubqTransformerConfig(**TINY), vocab_size=64,
                               max_sequence_length=16)
    state = {k: v for k, v in sas.state_dict().items() if ".core_attention." not in k}
    std.load_state_dict(state, strict=True)
    tokens, _, pos = make_batch(64, 2, 16)
    with torch.no_grad():
        out["identity_logits"], out["standard_logits"] = sas(tokens, pos, None), \
            std(tokens, pos, None)
    core_params = sum(p.numel() for n, p in sas.named_parameters() if ".core_attention." in n)
    out["added_params"] = (sum(p.numel() for p in sas.parameters())
                           - sum(p.numel() for p in std.parameters()), core_params)

    # training: random prefixes that repeat, so only attention can predict the repeats
    cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": "sas", "sas_heads": 8,
                                        "sas_head_dim": 24, "sas_kernel": 3})
    model = subq.build_gpt_model(cfg, vocab_size=64, max_sequence_length=32)
    out["losses"] = fit_repeating_batch(model, steps)
    return out


@pytest.fixture(scope="module")
def one_rank():
    return run_distributed(one_rank_world, 1, tp=1, args=(40,))[0]


def test_gpt_with_identity_expansion_is_the_standard_gpt(one_rank):
    torch.testing.assert_close(one_rank["identity_logits"], one_rank["standard_logits"],
                               rtol=1e-5, atol=1e-5)
    added, core = one_rank["added_params"]
    assert added == core > 0  # the SAS weights are the only extra parameters


def test_tiny_gpt_trains_with_falling_loss(one_rank):
    losses = one_rank["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.6 * losses[0], losses
