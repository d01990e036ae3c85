"""Mamba-2 without CUDA builds: the PyTorch ops (``megatron_subq.ops.mamba2``) against the
token-by-token recurrence, and ``SubqMambaMixer`` against an independent re-implementation, its
own decode path, its TP=2 (+SP) shards and checkpoints, and (GPU) megatron's ``MambaMixer``.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_subq.ops.mamba2 import (causal_conv1d, causal_conv1d_step, gated_rms_norm,
                                      ssd_chunk, ssd_naive, ssd_step)

F64 = torch.float64


def _ssd_inputs(b=2, T=37, H=4, P=3, G=2, N=5, dtype=F64, seed=0, D_hdim=False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)

    A = -torch.rand(H, generator=g, dtype=F64).to(dtype) * 2
    return dict(x=r(b, T, H, P), dt=r(b, T, H), A=A,
                B=r(b, T, G, N), C=r(b, T, G, N), D=r(H, P) if D_hdim else r(H),
                dt_bias=r(H, scale=0.5)), r(b, H, P, N)


# ------------------------------------------------------------------------------------ the ops
@pytest.mark.parametrize("T,chunk,G,D_hdim", [(37, 8, 2, False), (5, 8, 1, True), (32, 8, 4, False),
                                              (1, 128, 2, False)],
                         ids=["ragged", "shorter-than-chunk", "exact-chunks", "one-token"])
def test_chunked_scan_equals_the_recurrence(T, chunk, G, D_hdim):
    kw, s0 = _ssd_inputs(T=T, G=G, D_hdim=D_hdim)
    for init in (None, s0):
        y_ref, s_ref = ssd_naive(**kw, initial_state=init)
        y, s = ssd_chunk(**kw, chunk_size=chunk, initial_state=init)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


def test_recurrence_is_the_definition():
    """ssd_naive against the formulas written out for one head of group 1 (no broadcasting)."""
    kw, s0 = _ssd_inputs(T=6, H=4, G=2)
    y, s = ssd_naive(**kw, initial_state=s0)
    h, bi = 3, 1                                   # head 3 of 4 reads group 3 // 2 = 1
    S = s0[bi, h].clone()
    for t in range(6):
        dt = F.softplus(kw["dt"][bi, t, h] + kw["dt_bias"][h])
        S = torch.exp(dt * kw["A"][h]) * S + dt * torch.outer(kw["x"][bi, t, h], kw["B"][bi, t, 1])
        y_t = S @ kw["C"][bi, t, 1] + kw["D"][h] * kw["x"][bi, t, h]
        torch.testing.assert_close(y[bi, t, h], y_t)
    torch.testing.assert_close(s[bi, h], S)


def test_chunked_prefill_then_decode_steps_equal_one_scan():
    kw, s0 = _ssd_inputs(T=23)
    y_all, s_all = ssd_chunk(**kw, chunk_size=4, initial_state=s0)
    first = {k: (v[:, :9] if v.dim() > 2 or k == "dt" else v) for k, v in kw.items()}
    y0, state = ssd_chunk(**first, chunk_size=4, initial_state=s0)
    ys = [y0]
    for t in range(9, 23):
        y, state = ssd_step(state, kw["x"][:, t], kw["dt"][:, t], kw["A"], kw["B"][:, t],
                            kw["C"][:, t], kw["D"], kw["dt_bias"])
        ys.append(y[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), y_all, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, s_all, rtol=1e-10, atol=1e-10)


def test_chunked_scan_gradients_equal_the_recurrences():
    kw, s0 = _ssd_inputs(T=19, D_hdim=True)
    leaves = {**kw, "initial_state": s0}

    def grads(fn, **extra):
        ins = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        y, s = fn(**ins, **extra)
        g = torch.Generator().manual_seed(1)
        loss = (y * torch.randn(y.shape, generator=g, dtype=F64)).sum() + \
            (s * torch.randn(s.shape, generator=g, dtype=F64)).sum()
        loss.backward()
        return {k: v.grad for k, v in ins.items()}

    ref, got = grads(ssd_naive), grads(ssd_chunk, chunk_size=8)
    for name in leaves:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"grad of {n}: {m}")


def test_fp32_scan_of_bf16_inputs_tracks_float64():
    kw, s0 = _ssd_inputs(T=300, H=4, P=8, N=16)
    y64, _ = ssd_chunk(**kw, initial_state=s0)
    bf16 = {k: v.to(torch.bfloat16) for k, v in kw.items()}
    y16, s16 = ssd_chunk(**bf16, initial_state=s0.float())
    assert y16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    err = ((y16.double() - y64).norm() / y64.norm()).item()
    assert err < 2e-2, err


def _conv_loop(x, weight, bias, left):
    """y_t = silu(bias + sum_k weight[:, k] x_{t-W+1+k}), x before t=0 from ``left``."""
    W = weight.shape[1]
    full = torch.cat([left, x], dim=1)                         # [B, W-1+T, C]
    ys = [bias + sum(weight[:, k] * full[:, t + k] for k in range(W)) for t in range(x.shape[1])]
    return F.silu(torch.stack(ys, 1))


def test_causal_conv_and_its_decode_step():
    g = torch.Generator().manual_seed(0)
    b, T, C, W = 2, 9, 6, 4
    x = torch.randn(b, T, C, generator=g, dtype=F64)
    w, bias = torch.randn(C, W, generator=g, dtype=F64), torch.randn(C, generator=g, dtype=F64)
    state0 = torch.randn(b, C, W, generator=g, dtype=F64)
    y, final = causal_conv1d(x, w, bias)
    torch.testing.assert_close(y, _conv_loop(x, w, bias, x.new_zeros(b, W - 1, C)))
    torch.testing.assert_close(final, x[:, -W:].transpose(1, 2))
    y, final = causal_conv1d(x, w, bias, initial_state=state0)
    torch.testing.assert_close(y, _conv_loop(x, w, bias, state0[..., 1:].transpose(1, 2)))
    # prefill 4 tokens, then steps: the same outputs and state
    y4, state = causal_conv1d(x[:, :4], w, bias, initial_state=state0)
    ys = [y4]
    for t in range(4, T):
        yt, state = causal_conv1d_step(x[:, t], state, w, bias)
        ys.append(yt[:, None])
    torch.testing.assert_close(torch.cat(ys, 1), y)
    torch.testing.assert_close(state, final)
    # fewer tokens than the width: the state keeps the older ones
    _, short = causal_conv1d(x[:, :2], w, bias, initial_state=state0)
    torch.testing.assert_close(short, torch.cat([state0[..., 2:], x[:, :2].transpose(1, 2)], -1))


def test_gated_rms_norm_over_groups():
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(3, 8, generator=g, dtype=F64), torch.randn(3, 8, generator=g, dtype=F64)
    w = torch.randn(8, generator=g, dtype=F64)
    h = (x * torch.sigmoid(z) * z).reshape(3, 2, 4)
    ref = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 8) * w
    torch.testing.assert_close(gated_rms_norm(x, w, z, group_size=4), ref)


@pytest.mark.parametrize("change,needle", [
    (dict(x=torch.zeros(2, 5, 4)), "x has shape"),
    (dict(dt=torch.zeros(2, 5, 3)), "dt has shape"),
    (dict(A=torch.zeros(3)), "A has shape"),
    (dict(B=torch.zeros(2, 5, 3, 5), C=torch.zeros(2, 5, 3, 5)), "multiple of the groups"),
    (dict(C=torch.zeros(2, 5, 2, 4)), "C has shape"),
    (dict(D=torch.zeros(5)), "D has shape"),
    (dict(dt_bias=torch.zeros(2)), "dt_bias has shape"),
    (dict(initial_state=torch.zeros(2, 4, 3, 4)), "state has shape"),
    (dict(chunk_size=0), "chunk_size=0"),
])
def test_ops_reject_bad_input(change, needle):
    kw, s0 = _ssd_inputs(T=5, dtype=torch.float32)
    kw = {**kw, "initial_state": s0.float(), **change}
    with pytest.raises(ValueError, match=needle):
        ssd_chunk(**kw)
    with pytest.raises(ValueError, match="weight has shape"):
        causal_conv1d(torch.zeros(1, 3, 4), torch.zeros(5, 4))
    with pytest.raises(ValueError, match="conv state has shape"):
        causal_conv1d_step(torch.zeros(1, 4), torch.zeros(1, 4, 3), torch.zeros(4, 4))


# ------------------------------------------------------------------------------------ the mixer
SHAPE = dict(hidden_size=16, mamba_num_heads=4, mamba_head_dim=4, mamba_state_dim=4,
             mamba_num_groups=2)


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=1, num_attention_heads=2, use_cpu_initialization=True,
              params_dtype=F64, **SHAPE)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _mixer(config=None, pg_collection=None, **kwargs):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_subq.ssm import MambaMixerSubmodules, SubqMambaMixer

    config = config or _config()
    sub = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    kwargs = {"chunk_size": 4, "layer_number": 1, **kwargs}
    return SubqMambaMixer(config, sub, d_model=config.hidden_size, pg_collection=pg_collection,
                          **kwargs)


def _component_split(full, sizes, tp, rank):
    parts, start = [], 0
    for s in sizes:
        parts.append(full[start + rank * s // tp:start + (rank + 1) * s // tp])
        start += s
    return torch.cat(parts)


def _randomize(mixer, seed=5, tp=1, rank=0):
    """Move the parameters that start at constants (D, norm weight) and conv1d's bias off them:
    the same full TP=1 values at any TP size, rank ``rank`` keeping its share."""
    g = torch.Generator().manual_seed(seed)
    gn = mixer.ngroups * mixer.d_state
    with torch.no_grad():
        for p, sizes in ((mixer.D, [mixer.D.shape[0] * tp]), (mixer.norm.weight, [mixer.d_inner]),
                         (mixer.conv1d.bias, [mixer.d_inner, gn, gn])):
            full = torch.rand(sum(sizes), generator=g, dtype=F64) + 0.5
            p.copy_(_component_split(full, sizes, tp, rank))


def _reference_mixer(m, h):
    """The mixer's math from its weights, independently of its code: explicit matmuls, the conv
    as a loop, ``ssd_naive``, the gated group norm written out. h: [s, b, d] -> [s, b, d]."""
    d_in, N, H, P = m.d_inner, m.d_state, m.nheads, m.headdim
    G = m.ngroups
    zxbcdt = (h @ m.in_proj.weight.t()).transpose(0, 1)                  # [b, s, .]
    z = zxbcdt[..., :d_in]
    xBC = zxbcdt[..., d_in:2 * d_in + 2 * G * N]
    dt = zxbcdt[..., 2 * d_in + 2 * G * N:]
    w = m.conv1d.weight[:, 0, :]
    xBC = _conv_loop(xBC, w, m.conv1d.bias,
                     xBC.new_zeros(xBC.shape[0], w.shape[1] - 1, xBC.shape[2]))
    b, s = xBC.shape[:2]
    x = xBC[..., :d_in].reshape(b, s, H, P)
    B = xBC[..., d_in:d_in + G * N].reshape(b, s, G, N)
    C = xBC[..., d_in + G * N:].reshape(b, s, G, N)
    D = m.D.reshape(H, P) if m.D_has_hdim else m.D
    y, _ = ssd_naive(x, dt, -torch.exp(m.A_log), B, C, D, m.dt_bias)
    y = y.reshape(b, s, d_in) * F.silu(z)
    yg = y.reshape(b, s, G, d_in // G)
    yg = yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)
    y = yg.reshape(b, s, d_in) * m.norm.weight
    return (y @ m.out_proj.weight.t()).transpose(0, 1)


@pytest.fixture(scope="module")
def single_process():
    from megatron_subq import destroy_single_process, init_single_process

    init_single_process()
    yield
    destroy_single_process()


@pytest.mark.parametrize("D_has_hdim", [False, True], ids=["D-per-head", "D-per-channel"])
def test_mixer_equals_an_independent_reimplementation(single_process, D_has_hdim):
    torch.manual_seed(0)
    m = _mixer(D_has_hdim=D_has_hdim)
    _randomize(m)
    h = torch.randn(11, 2, 16, dtype=F64)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    out, bias = m(h1)
    ref = _reference_mixer(m, h2)
    assert bias is None and out.shape == h.shape
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    params = dict(m.named_parameters())
    dout = torch.randn_like(out)
    got = dict(zip(["input", *params], torch.autograd.grad(out, [h1, *params.values()], dout)))
    want = dict(zip(["input", *params], torch.autograd.grad(ref, [h2, *params.values()], dout)))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda msg, n=name: f"grad of {n}: {msg}")


def test_mixer_parameters_match_megatrons_layout(single_process):
    m = _mixer(_config(params_dtype=torch.float32))
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in m.named_parameters()}
    d_in, conv = 16, 16 + 2 * 2 * 4
    f32 = torch.float32
    assert shapes == {"dt_bias": ((4,), f32), "A_log": ((4,), f32), "D": ((4,), f32),
                      "in_proj.weight": ((2 * d_in + 2 * 8 + 4, 16), f32),
                      "conv1d.weight": ((conv, 1, 4), f32), "conv1d.bias": ((conv,), f32),
                      "norm.weight": ((d_in,), f32), "out_proj.weight": ((16, d_in), f32)}
    for name in ("dt_bias", "A_log", "D", "conv1d.weight", "conv1d.bias", "norm.weight"):
        p = m.get_parameter(name)
        assert p.tensor_model_parallel and p.partition_dim == 0, name
    dt = F.softplus(m.dt_bias)
    assert bool(((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all())
    assert bool(((-m.A_log.exp() <= -1) & (-m.A_log.exp() >= -16)).all())
    assert bool((m.D == 1).all() and (m.norm.weight == 1).all())
    # bf16 params: megatron keeps A_log and D in float32
    mb = _mixer(_config(params_dtype=torch.bfloat16, bf16=True))
    assert mb.A_log.dtype == mb.D.dtype == torch.float32
    assert mb.dt_bias.dtype == mb.conv1d.weight.dtype == mb.norm.weight.dtype == torch.bfloat16


def _megatrons_mixer_on_the_cpu(monkeypatch, config, pg_collection=None):
    """megatron's own MambaMixer built here: its mamba_ssm gate lifted and mamba_ssm's gated
    norm (``ExtendedRMSNorm``) stood in for by ours with megatron's sharded_state_dict (the CPU
    fallbacks point its ``torch.cuda.current_device()`` at the CPU). It can build and
    checkpoint, not run: its scan is mamba_ssm's."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import mamba_mixer as mm
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from megatron_subq.ssm import GatedRMSNorm, MambaMixerSubmodules

    class StandInNorm(GatedRMSNorm):
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """ExtendedRMSNorm's: weight TP-sharded along dim 0 over the global TP group."""
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
                dp_cp_group=metadata["dp_cp_group"])

    monkeypatch.setattr(mm, "HAVE_MAMBA_SSM", True)
    monkeypatch.setattr(mm, "ExtendedRMSNorm", StandInNorm)
    pg = pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    sub = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    return mm.MambaMixer(config, sub, d_model=config.hidden_size, layer_number=1, pg_collection=pg)


def _sharded_layout(sharded):
    """{key: (global shape, global offset)} of every ShardedTensor, factories built."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for key, value in sharded.items():
        if isinstance(value, ShardedTensorFactory):
            for t in value.build():
                out[t.key] = (t.global_shape, t.global_offset)
        elif isinstance(value, ShardedTensor):
            out[value.key] = (value.global_shape, value.global_offset)
        else:
            out[value.key] = type(value).__name__
    return out


def test_same_constructor_parameters_and_checkpoint_keys_as_megatrons_mixer(single_process,
                                                                             monkeypatch):
    import inspect

    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_subq.ssm import SubqMambaMixer

    ours_sig = inspect.signature(SubqMambaMixer.__init__).parameters
    theirs_sig = inspect.signature(MambaMixer.__init__).parameters
    assert [(n, p.default, p.kind) for n, p in ours_sig.items()] == \
        [(n, p.default, p.kind) for n, p in theirs_sig.items()]
    config = _config(params_dtype=torch.bfloat16, bf16=True)
    for tp_rank in (None, 0, 1):     # TP=1, then both ranks of a TP=2 layout
        pg = None if tp_rank is None else _fake_pg(tp_rank, 2)
        theirs = _megatrons_mixer_on_the_cpu(monkeypatch, config, pg)
        ours = _mixer(config, pg)
        assert [(n, p.shape, p.dtype, getattr(p, "tensor_model_parallel", False))
                for n, p in ours.named_parameters()] == \
            [(n, p.shape, p.dtype, getattr(p, "tensor_model_parallel", False))
             for n, p in theirs.named_parameters()]
    theirs, ours = _megatrons_mixer_on_the_cpu(monkeypatch, config), _mixer(config)
    assert _sharded_layout(ours.sharded_state_dict("mixer.")) == \
        _sharded_layout(theirs.sharded_state_dict("mixer."))
    ours.load_state_dict(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))


def test_mixer_decode_steps_equal_its_forward(single_process):
    from megatron.core.inference.contexts import StaticInferenceContext

    torch.manual_seed(1)
    m = _mixer().eval()
    _randomize(m)
    h = torch.randn(13, 3, 16, dtype=F64)
    with torch.no_grad():
        full, _ = m(h)
        conv_state, ssm_state = m.allocate_inference_cache(3)
        steps = torch.cat([m.step(h[t:t + 1], conv_state, ssm_state)[0] for t in range(13)])
        torch.testing.assert_close(steps, full, rtol=1e-10, atol=1e-10)
        # megatron's static inference context: a 6-token prompt, then one token at a time
        ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=13)
        outs = [m(h[:6], inference_context=ctx)[0]]
        for t in range(6, 13):
            ctx.sequence_len_offset = t
            outs.append(m(h[t:t + 1], inference_context=ctx)[0])
        torch.testing.assert_close(torch.cat(outs), full, rtol=1e-10, atol=1e-10)
        ctx.sequence_len_offset = 0  # a new prompt starts from zero states
        torch.testing.assert_close(m(h[:6], inference_context=ctx)[0], full[:6])


class _FakeGroup:
    """A process group's size and rank, for building a rank's shards in one process."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def _fake_pg(rank, tp, cp=1):
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(tp=_FakeGroup(rank, tp), cp=_FakeGroup(0, cp))


def test_tp2_shards_are_the_tp1_weights_split_by_component(single_process):
    """use_cpu_initialization: rank r's in_proj rows are [z_r|x_r|B_r|C_r|dt_r] of the TP=1
    matrix, its conv channels [x_r|B_r|C_r], its heads' A_log/dt_bias/D/norm; out_proj's columns."""
    config = _config(tensor_model_parallel_size=1)
    torch.manual_seed(3)
    full = dict(_mixer(config).named_parameters())
    after_tp1 = torch.rand(3)
    d_in, gn, H = 16, 8, 4
    splits = {"in_proj.weight": [d_in, d_in, gn, gn, H], "conv1d.weight": [d_in, gn, gn],
              "conv1d.bias": [d_in, gn, gn]}
    for rank in range(2):
        torch.manual_seed(3)
        shard = dict(_mixer(config, _fake_pg(rank, 2)).named_parameters())
        torch.testing.assert_close(torch.rand(3), after_tp1, rtol=0, atol=0,
                                   msg="the mixer draws the same random numbers at any TP")
        for name, p in shard.items():
            if name == "out_proj.weight":
                want = full[name][:, rank * 8:(rank + 1) * 8]
            else:
                sizes = splits.get(name, [full[name].shape[0]])
                want = _component_split(full[name], sizes, 2, rank)
            torch.testing.assert_close(p, want, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("overrides,pg,needle", [
    (dict(mamba_num_heads=6, mamba_num_groups=2), (0, 4),
     r"mamba_num_heads=6 is invalid.*multiple of tensor_model_parallel_size=4"),
    (dict(mamba_num_heads=4, mamba_num_groups=1), (0, 2),
     r"mamba_num_groups=1 is invalid.*tensor_model_parallel_size=2"),
    (dict(mamba_num_heads=4, mamba_num_groups=3), None,
     r"mamba_num_groups=3 is invalid.*divisor of mamba_num_heads=4"),
    (dict(mamba_num_heads=None, mamba_head_dim=5), None, r"expand \* hidden_size=32 is invalid"),
    (dict(mamba_state_dim=0), None, r"mamba_state_dim=0 is invalid"),
], ids=["heads-vs-tp", "groups-vs-tp", "heads-vs-groups", "headdim", "state-dim"])
def test_mixer_rejects_bad_sizes(single_process, overrides, pg, needle):
    with pytest.raises(ValueError, match=needle):
        _mixer(_config(**overrides), None if pg is None else _fake_pg(*pg))


def test_mixer_rejects_unsupported_modes(single_process):
    with pytest.raises(ValueError, match=r"context_parallel_size=3 is invalid: allowed "
                                         r"\(--context-parallel-size\) a divisor of the Mamba "
                                         r"heads per tensor-parallel rank \(4 / 1 = 4\)"):
        _mixer(pg_collection=_fake_pg(0, 1, cp=3))
    with pytest.raises(ValueError, match=r"context_parallel_size=4 is invalid: .* a divisor or a "
                                         r"multiple of the Mamba groups per tensor-parallel rank "
                                         r"\(mamba_num_groups=3 / 1 = 3\)"):
        _mixer(_config(mamba_num_heads=12, mamba_num_groups=3), _fake_pg(0, 1, cp=4))
    cp2 = _mixer(pg_collection=_fake_pg(0, 1, cp=2))  # CP=2 builds; no inference under CP
    cp2.eval()
    with pytest.raises(ValueError, match="inference with context_parallel_size=2"):
        cp2(torch.zeros(4, 1, 16, dtype=F64), inference_context=object())
    with pytest.raises(ValueError, match="bias=True is invalid"):
        _mixer(bias=True)
    m = _mixer()
    with pytest.raises(ValueError, match="--reset-attention-mask"):
        m(torch.zeros(4, 1, 16, dtype=F64), packed_seq_params=object())
    with pytest.raises(ValueError, match=r"expected \[1, b, 16\]"):
        m.step(torch.zeros(2, 1, 16, dtype=F64), *m.allocate_inference_cache(1))


def test_mixer_builds_on_the_meta_device(single_process):
    """Nano's mixer (hidden 2688, 64 heads x 64, state 128, 8 groups) without allocating:
    megatron's parameter count."""
    config = _config(hidden_size=2688, num_attention_heads=32, mamba_num_heads=64,
                     mamba_head_dim=64, mamba_state_dim=128, mamba_num_groups=8,
                     params_dtype=torch.bfloat16)
    with torch.device("meta"):
        m = _mixer(config)
    assert all(p.is_meta for p in m.parameters())
    d_in, conv = 4096, 4096 + 2 * 8 * 128
    assert sum(p.numel() for p in m.parameters()) == (
        2688 * (2 * d_in + 2 * 8 * 128 + 64) + conv * 4 + conv + 3 * 64 + d_in + d_in * 2688)


def test_mixer_class_choice():
    from megatron_subq.ssm import SubqMambaMixer, mamba_mixer_class, megatron_mamba_mixer_usable

    assert mamba_mixer_class(impl="pytorch") is SubqMambaMixer
    with pytest.raises(ValueError, match="impl='fast' is invalid"):
        mamba_mixer_class(impl="fast")
    usable, why = megatron_mamba_mixer_usable()
    if not usable:
        assert mamba_mixer_class() is SubqMambaMixer
        with pytest.raises(ValueError, match="impl='megatron' is unusable here"):
            mamba_mixer_class(impl="megatron")


# ------------------------------------------------------------------- TP=2 (+SP) and checkpoints
def _unshard(local, sizes, dim=0):
    """All-gather a TP shard whose dim holds [c0_r | c1_r | ...] and reassemble each component."""
    world = torch.distributed.get_world_size()
    shards = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(shards, local.contiguous())
    pieces = [s.split([c // world for c in sizes], dim=dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=dim) for i in range(len(sizes))],
                     dim=dim)


def _tp_worker(ckpt_dir):
    """In a 2-rank world: the mixer at TP=1, TP=2 and TP=2+SP on the same data (output, input
    gradient, every gathered parameter gradient); then a TP=2 checkpoint loaded at TP=1."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from megatron_subq.testing.checkpoint import reinit_tensor_parallel

    g = torch.Generator().manual_seed(11)
    h = torch.randn(10, 2, 16, generator=g, dtype=F64)
    dout = torch.randn(10, 2, 16, generator=g, dtype=F64)
    d_in, gn, H = 16, 8, 4
    sizes = {"in_proj.weight": [d_in, d_in, gn, gn, H], "conv1d.weight": [d_in, gn, gn],
             "conv1d.bias": [d_in, gn, gn]}

    def run(tp, sp=False):
        torch.manual_seed(7)
        m = _mixer(_config(tensor_model_parallel_size=tp, sequence_parallel=sp))
        rank = torch.distributed.get_rank() if tp > 1 else 0
        _randomize(m, tp=tp, rank=rank)
        inp = (h.chunk(tp)[rank] if sp else h).clone().requires_grad_()
        out, _ = m(inp)
        out.backward(dout.chunk(tp)[rank] if sp else dout)
        res = {"out": out.detach(), "dinput": inp.grad}
        if sp:
            res = {k: gather_from_sequence_parallel_region(v, tensor_parallel_output_grad=False)
                   for k, v in res.items()}
        for name, p in m.named_parameters():
            if tp == 1:
                res[name] = p.grad
            elif name == "out_proj.weight":
                res[name] = _unshard(p.grad, [p.grad.shape[1] * tp], dim=1)
            else:
                res[name] = _unshard(p.grad, sizes.get(name, [p.shape[0] * tp]))
        return m, res

    reinit_tensor_parallel(1)
    _, tp1 = run(1)
    reinit_tensor_parallel(2)
    m2, tp2 = run(2)
    _, tp2sp = run(2, sp=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(m2.sharded_state_dict(prefix="mixer."), ckpt_dir)
    keys = sorted(m2.sharded_state_dict(prefix="mixer.").keys())
    reinit_tensor_parallel(1)
    torch.manual_seed(99)                            # other weights, replaced by the checkpoint
    m1 = _mixer(_config())
    state = dist_checkpointing.load(m1.sharded_state_dict(prefix="mixer."), ckpt_dir)
    state = {k[len("mixer."):]: v for k, v in state.items()}
    missing, unexpected = m1.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), \
        (missing, unexpected)
    with torch.no_grad():
        loaded = m1(h)[0]
    return {"tp1": tp1, "tp2": tp2, "tp2sp": tp2sp, "loaded_tp1": loaded, "keys": keys}


@pytest.mark.slow  # the whole hybrid's TP=2+SP / TP=2 / checkpoint tests cover it (test_hybrid.py)
def test_tp2_and_sp_equal_tp1_and_checkpoints_reshard(tmp_path):
    from megatron_subq.testing import run_distributed

    ranks = run_distributed(_tp_worker, 2, tp=2, args=(str(tmp_path / "ckpt"),))
    for rank, r in enumerate(ranks):
        for case in ("tp2", "tp2sp"):
            assert r[case].keys() == r["tp1"].keys()
            for name, ref in r["tp1"].items():
                where = f"rank {rank} {case} {name}"
                torch.testing.assert_close(r[case][name], ref, rtol=1e-9, atol=1e-11,
                                           msg=lambda m, w=where: f"{w}: {m}")
        torch.testing.assert_close(r["loaded_tp1"], r["tp2"]["out"], rtol=1e-9, atol=1e-11)
    assert ranks[0]["keys"] == ["mixer." + k for k in (
        "A_log", "D", "conv1d.bias", "conv1d.weight", "dt_bias", "in_proj._extra_state",
        "in_proj.weight", "norm.weight", "out_proj._extra_state", "out_proj.weight")]
    assert os.path.isdir(tmp_path / "ckpt")


# ---------------------------------------------------------------------------- GPU: vs megatron
GPU_SHAPE = dict(hidden_size=256, num_attention_heads=4, mamba_num_heads=8, mamba_head_dim=64,
                 mamba_state_dim=64, mamba_num_groups=2)
# relative-RMS bounds of SubqMambaMixer against megatron's MambaMixer (mamba_ssm's Triton SSD:
# TF32 dots in float32; bfloat16 operands of its dots in bfloat16)
GPU_RTOL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("mem_eff", [True, False], ids=["fused-path", "unfused-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_megatron_mamba_mixer_equals_ours_on_gpu(single_process, dtype, mem_eff):
    """megatron's MambaMixer (mamba_ssm's Triton kernels) and SubqMambaMixer with the same
    weights: output, input gradient and every parameter gradient, T=1000 (not a multiple of the
    chunk of 128), 2 groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import mamba_mixer as mm
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_subq.ssm import MambaMixerSubmodules, SubqMambaMixer
    from megatron_subq.testing.kernels import rel_rms

    if not mm.HAVE_MAMBA_SSM:
        pytest.skip("mamba_ssm is not importable")
    if mem_eff and mm.causal_conv1d_fn is None:
        pytest.skip("causal_conv1d is not importable: megatron's fused path needs it")
    config = _config(use_cpu_initialization=False, params_dtype=dtype,
                     bf16=dtype == torch.bfloat16, use_mamba_mem_eff_path=mem_eff, **GPU_SHAPE)
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    sub = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)
    torch.manual_seed(0)
    theirs = mm.MambaMixer(config, sub, d_model=256, layer_number=1, pg_collection=pg)
    ours = SubqMambaMixer(config, sub, d_model=256, layer_number=1, pg_collection=pg).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in (theirs.D, theirs.norm.weight, theirs.conv1d.bias):
            p.copy_(torch.rand(p.shape, generator=g, device="cuda") + 0.5)
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    ours.load_state_dict(theirs.state_dict())

    # the float64 truth: our math in float64, to tell a loose bound from a wrong result
    truth = SubqMambaMixer(_config(use_cpu_initialization=False, params_dtype=F64, **GPU_SHAPE),
                           sub, d_model=256, layer_number=1, pg_collection=pg).cuda()
    truth.load_state_dict(theirs.state_dict())

    h = torch.randn(1000, 2, 256, generator=g, device="cuda")
    dout = torch.randn(1000, 2, 256, generator=g, device="cuda")
    results = {}
    for who, m, dt in (("megatron", theirs, dtype), ("ours", ours, dtype), ("truth", truth, F64)):
        inp = h.to(dt).clone().requires_grad_()
        out, _ = m(inp)
        out.backward(dout.to(dt))
        results[who] = {"out": out.detach(), "dinput": inp.grad,
                        **{n: p.grad for n, p in m.named_parameters()}}
    names = list(results["megatron"])
    assert set(results["ours"]) == set(names)
    worst = {n: rel_rms(results["ours"][n], results["megatron"][n]) for n in names}
    bad = {n: e for n, e in worst.items() if not e <= GPU_RTOL[dtype]}
    vs_truth = {n: (rel_rms(results["ours"][n], results["truth"][n]),
                    rel_rms(results["megatron"][n], results["truth"][n])) for n in names}
    assert not bad, (f"relative RMS of ours vs megatron beyond {GPU_RTOL[dtype]}: {bad}; "
                     f"(ours, megatron) vs float64: {vs_truth}")
