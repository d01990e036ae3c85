"""Issue 21's fused local path: the Triton RMSNorm against the unfused norm (forward, input and
weight gradients), the fusion flags reaching the config and the modules of both hosts, a tiny
GPT trained with every fusion on against off, and the refusals naming their flag.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
in fp32 and fp16 (the interpreter mis-computes bf16 dots); the bf16 cases at the 1.3B model's
shapes are GPU tests.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq import SubqTransformerConfig  # noqa: E402
from megatron_subq.kernels.fused import rms_norm_reference  # noqa: E402
from megatron_subq.norm import FusedLocalNorm, LocalNorm  # noqa: E402
from megatron_subq.testing.kernels import rel_rms  # noqa: E402
from megatron_subq.training import arguments  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative RMS

MIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
       "--eval-iters", "0", "--eval-interval", "100"]
# every fusion that keeps fp32 math exact (--cross-entropy-loss-fusion needs --bf16: below)
FUSIONS = ["--subq-fused-rope", "--subq-fused-norm", "--bias-swiglu-fusion",
           "--bias-dropout-fusion"]


def _config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    base.update(kw)
    return SubqTransformerConfig(**base)


def _compare_norm(shape, dtype, zero_centered=False, device=DEVICE, seed=0):
    """FusedLocalNorm against LocalNorm (the unfused local norm) with the same weight: output,
    input gradient and weight gradient."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    cfg = _config(layernorm_zero_centered_gamma=zero_centered, params_dtype=dtype)
    ref, fused = LocalNorm(cfg, hidden), FusedLocalNorm(cfg, hidden)
    u = torch.rand(hidden, generator=g)
    weight = u * 0.3 - 0.15 if zero_centered else u * 0.5 + 0.75  # the stored parameter
    for m in (ref, fused):
        m.to(device)
        with torch.no_grad():
            m.weight.copy_(weight.to(dtype))
    x = (torch.randn(shape, generator=g) * 2.0 + 0.5).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    out = {}
    for name, m in (("ref", ref), ("fused", fused)):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (gx, gw) = torch.autograd.grad(y, (xi, m.weight), dy)
        out[name] = (y, gx, gw)
    for what, a, b in zip(("y", "dx", "dweight"), out["fused"], out["ref"]):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        err = rel_rms(a.float(), b.float())
        assert err <= TOL[dtype], f"{what}: relative RMS {err:.2e} > {TOL[dtype]:.0e}"
    return out


@pytest.mark.parametrize("shape,zero_centered", [
    ((37, 2688), False),          # ragged rows, the hidden size of a 2688-wide model
    ((5, 3, 100), True),          # [s, b, h], zero-centred gamma, hidden not a power of two
    ((1, 1, 64), False),          # one row
    ((13, 2, 129), False),        # more rows than the interpreter's 4 weight-gradient programs
])
def test_fused_rmsnorm_matches_local_norm_fp32(shape, zero_centered):
    _compare_norm(shape, torch.float32, zero_centered)


def test_fused_rmsnorm_fp16():
    _compare_norm((9, 2, 320), torch.float16)


def test_fused_rmsnorm_against_its_reference_and_edge_inputs():
    from megatron_subq.kernels.fused import rms_norm_kernel

    x = torch.randn(6, 4, 48, device=DEVICE).transpose(0, 1)  # not contiguous
    w = torch.rand(48, device=DEVICE) + 0.5
    y = rms_norm_kernel(x, w, 1e-6)
    assert rel_rms(y, rms_norm_reference(x, w, 1e-6)) <= 1e-6
    empty = torch.zeros(0, 48, device=DEVICE, requires_grad=True)
    wg = w.clone().requires_grad_()
    rms_norm_kernel(empty, wg, 1e-5).sum().backward()
    assert empty.grad.shape == (0, 48) and torch.count_nonzero(wg.grad) == 0
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm_kernel(x, w[:10], 1e-5)


# ---- RoPE --------------------------------------------------------------------------------
def _freqs(seq, rot, base=10000.0, offset=0):
    """megatron's RotaryEmbedding freqs: ``cat(f, f)`` of shape ``[seq, 1, 1, rot]``, fp32."""
    inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.outer(torch.arange(offset, offset + seq, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :].to(DEVICE)


def _compare_rope(S, B, H, D, rot, dtype, device=DEVICE, seed=0):
    """The fused RoPE against megatron's unfused ``_apply_rotary_pos_emb_bshd``, on a strided
    view into a fused QKV tensor as megatron's attention passes it: output and input gradient."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_subq.rope import fused_rope_bshd

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(S, B, H, 3 * D, generator=g).to(device=device, dtype=dtype)
    freqs = _freqs(S, rot).to(device)
    dy = torch.randn(S, B, H, D, generator=g).to(device=device, dtype=dtype)
    outs = []
    for fn in (fused_rope_bshd, _apply_rotary_pos_emb_bshd):
        base = qkv.clone().requires_grad_()
        x = base[..., D:2 * D]  # not contiguous
        y = fn(x, freqs)
        (gx,) = torch.autograd.grad(y, base, dy)
        outs.append((y, gx))
    for what, a, b in zip(("y", "dx"), *outs):
        assert a.dtype == b.dtype and a.shape == b.shape, what
        err = rel_rms(a.float(), b.float())
        assert err <= TOL[dtype], f"{what}: relative RMS {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("S,B,H,D,rot", [
    (7, 2, 3, 24, 24),   # ragged heads and sizes
    (5, 1, 4, 40, 20),   # partial rotary: the last 20 features pass through
    (3, 3, 1, 128, 128),
])
def test_fused_rope_matches_megatron_unfused_fp32(S, B, H, D, rot):
    _compare_rope(S, B, H, D, rot, torch.float32)


def test_fused_rope_fp16():
    _compare_rope(6, 2, 5, 64, 64, torch.float16)


def test_fused_rope_packed_sequences_match_megatron_thd():
    """Packed documents (THD): megatron's per-document positions, one kernel call."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from megatron_subq.rope import fused_rope_thd

    class _Group:  # a context-parallel group of one
        def size(self):
            return 1

        def rank(self):
            return 0

    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32, device=DEVICE)
    t = torch.randn(13, 3, 16, device=DEVICE)
    for freqs in (_freqs(8, 16), _freqs(13, 16)):  # max length, and one row per packed token
        ref = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_Group())
        assert rel_rms(fused_rope_thd(t, cu, freqs), ref) <= 1e-6


def test_fused_rope_refuses_interleaved():
    with pytest.raises(ValueError, match="subq_fused_rope"):
        _config(subq_fused_rope=True, rotary_interleaved=True)


def test_fused_norm_refuses_layernorm():
    with pytest.raises(ValueError, match="subq_fused_norm"):
        _config(normalization="LayerNorm", subq_fused_norm=True)


# ---- the flags reach the config and the modules -------------------------------------------
def _in_process_group(fn):
    """Run ``fn()`` with a one-process gloo group and megatron's parallel state (then tear down)."""
    from megatron.core import parallel_state

    from megatron_subq.distributed import free_port
    from megatron_subq.testing.distributed import init_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        init_parallel()
        return fn()
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _norm_types(model):
    return {type(m) for m in model.modules() if isinstance(m, LocalNorm)}


def test_flags_reach_config_and_both_hosts():
    from megatron_subq import build_gpt_model
    from megatron_subq.hybrid import build_hybrid_model
    from megatron_subq.testing.hybrid import hybrid_test_config
    from megatron_subq.training.trainer import build_config

    args = arguments.parse_args(MIN + FUSIONS + ["--qk-layernorm", "--bf16",
                                                 "--cross-entropy-loss-fusion"], world_size=1)
    config = build_config(args)
    assert (config.subq_fused_norm, config.bias_activation_fusion, config.bias_dropout_fusion,
            config.cross_entropy_loss_fusion, config.cross_entropy_fusion_impl,
            config.subq_fused_rope, config.apply_rope_fusion) == (
        True, True, True, True, "native", True, True)
    off = build_config(arguments.parse_args(MIN, world_size=1))  # the defaults are unchanged
    assert not (off.subq_fused_norm or off.bias_activation_fusion or off.bias_dropout_fusion
                or off.cross_entropy_loss_fusion or off.apply_rope_fusion)

    def build():
        gpt = build_gpt_model(config, vocab_size=128, max_sequence_length=32, use_te=False)
        plain = build_gpt_model(off, vocab_size=128, max_sequence_length=32, use_te=False)
        hybrid = build_hybrid_model(hybrid_test_config(subq_fused_norm=True), vocab_size=128,
                                    max_sequence_length=32, use_te=False)
        layer = gpt.decoder.layers[0]
        return (_norm_types(gpt), _norm_types(plain), _norm_types(hybrid),
                type(layer.self_attention.q_layernorm), type(gpt.decoder.final_layernorm),
                type(hybrid.decoder.final_norm), sorted(gpt.state_dict()) ==
                sorted(k for k in build_gpt_model(
                    build_config(arguments.parse_args(MIN + ["--qk-layernorm"], world_size=1)),
                    vocab_size=128, max_sequence_length=32, use_te=False).state_dict()))

    gpt, plain, hybrid, qk, final, hybrid_final, same_keys = _in_process_group(build)
    assert gpt == {FusedLocalNorm} and hybrid == {FusedLocalNorm} and plain == {LocalNorm}
    assert qk is FusedLocalNorm and final is FusedLocalNorm and hybrid_final is FusedLocalNorm
    assert same_keys  # the same checkpoint keys with and without the fused norm


def test_fused_rope_runs_in_the_model(monkeypatch):
    """A GPT built with subq_fused_rope sends its queries and keys through the fused RoPE (the
    hook megatron's apply_rope_fusion calls) and gives the unfused model's logits."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_subq import build_gpt_model
    from megatron_subq.rope import fused_rope_bshd

    calls = []
    config = _config(subq_fused_rope=True, num_query_groups=2)
    spied = rope_utils.fused_apply_rotary_pos_emb is fused_rope_bshd  # not TE's
    if spied:
        def spy(t, freqs, interleaved=False):
            calls.append(tuple(t.shape))
            return fused_rope_bshd(t, freqs, interleaved)

        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", spy)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)

    def logits():
        out = []
        for cfg in (config, _config(num_query_groups=2)):
            torch.manual_seed(0)
            model = build_gpt_model(cfg, vocab_size=128, max_sequence_length=16, use_te=False)
            out.append(model(tokens, positions, None).detach())
        return out

    fused, plain = _in_process_group(logits)
    assert config.apply_rope_fusion
    if spied:
        assert len(calls) == 4, calls  # 2 layers x (query, key)
    assert rel_rms(fused, plain) <= 1e-6


def test_every_fusion_trains_like_the_unfused_path():
    """3 iterations of a tiny GPT (fp32) with the fused norm, megatron's SwiGLU, bias-dropout-add
    and cross-entropy fusions on, against all off: the same losses to fp32 rounding (Adam
    carries the rounding differences of the first step into the later ones)."""
    from megatron_subq.training import pretrain

    off = pretrain(MIN)["iterations"]
    on = pretrain(MIN + FUSIONS)["iterations"]
    assert sorted(on) == sorted(off) == [1, 2, 3]
    assert on[1] == pytest.approx(off[1], rel=1e-6)
    for it in (2, 3):
        assert on[it] == pytest.approx(off[it], rel=2e-5), (it, on, off)


def test_fused_cross_entropy_is_exact_in_bf16_and_runs_in_the_model(monkeypatch):
    """megatron-core's fused cross-entropy against its unfused one on bf16 logits (the only
    dtype the trainer allows it with: its backward rounds the gradient to bf16): the same loss
    and gradient; and a model built with the flag's config field computes its loss through it."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.models.common.language_module import language_module

    from megatron_subq import build_gpt_model

    calls = []

    def spy(logits, labels, group):
        calls.append(tuple(logits.shape))
        return fused_vocab_parallel_cross_entropy(logits, labels, group)

    monkeypatch.setattr(language_module, "fused_vocab_parallel_cross_entropy", spy)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 2, 128, generator=g) * 3).to(torch.bfloat16)
    target = torch.randint(0, 128, (16, 2), generator=g)
    tokens, labels = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)

    def run():
        out = []
        for fn in (tensor_parallel.vocab_parallel_cross_entropy,
                   lambda x, t: fused_vocab_parallel_cross_entropy(
                       x, t, parallel_state.get_tensor_model_parallel_group())):
            x = logits.clone().requires_grad_()
            loss = fn(x, target)
            out.append((loss.detach(), torch.autograd.grad(loss.sum(), x)[0]))
        losses = []
        for fused in (False, True):
            torch.manual_seed(0)
            model = build_gpt_model(_config(cross_entropy_loss_fusion=fused), vocab_size=128,
                                    max_sequence_length=16, use_te=False)
            losses.append(model(tokens, positions, None, labels=labels).detach())
        return out, losses

    (plain, fused), (loss_off, loss_on) = _in_process_group(run)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=0)
    assert fused[1].dtype == torch.bfloat16
    assert calls == [(16, 2, 128)]  # the model's loss went through it (its forward with labels)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)


def _error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        arguments.parse_args(argv, world_size=1)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("extra,flag", [
    (["--bias-swiglu-fusion", "--no-swiglu"], "--bias-swiglu-fusion"),
    (["--bias-swiglu-fusion", "--squared-relu"], "--bias-swiglu-fusion"),
    (["--apply-rope-fusion"], "--apply-rope-fusion"),
    (["--masked-softmax-fusion"], "--masked-softmax-fusion"),
    (["--persist-layer-norm"], "--persist-layer-norm"),
    (["--gradient-accumulation-fusion"], "--gradient-accumulation-fusion"),
    (["--cross-entropy-loss-fusion", "--bf16", "--cross-entropy-fusion-impl", "te"],
     "--cross-entropy-fusion-impl"),
    (["--cross-entropy-loss-fusion"], "--cross-entropy-loss-fusion"),  # fp32: needs --bf16
    (["--subq-fused-adam", "--optimizer", "sgd"], "--subq-fused-adam"),
])
def test_bad_fusion_flags_name_the_flag(extra, flag, capsys):
    if (flag in ("--apply-rope-fusion", "--cross-entropy-fusion-impl")
            and arguments._importable("transformer_engine") and torch.cuda.is_available()):
        pytest.skip("Transformer Engine is present: the flag is allowed")
    err = _error(MIN + extra, capsys)
    assert flag in err


def test_fused_norm_with_layernorm_names_its_flag(capsys):
    from megatron_subq.training.trainer import build_config

    args = arguments.parse_args(MIN + ["--subq-fused-norm", "--normalization", "LayerNorm"],
                                world_size=1)
    with pytest.raises(SystemExit):
        build_config(args)
    assert "--subq-fused-norm" in capsys.readouterr().err


# ---- GPU: bf16 at real shapes -----------------------------------------------------------
# ---- --subq-fused-adam ---------------------------------------------------------------------
def _spy_runs(monkeypatch):
    """Each pretrain() run's megatron optimizer, and the calls of torch's fused Adam kernel."""
    from torch.optim import adam

    from megatron_subq.training import trainer

    seen, fused_calls = [], []
    step, fused = trainer.train_step, adam._fused_adam

    def train_step(args, model, optimizer, *rest):
        if not seen or seen[-1] is not optimizer:
            seen.append(optimizer)
        return step(args, model, optimizer, *rest)

    def fused_adam(*a, **kw):
        fused_calls.append(len(seen))
        return fused(*a, **kw)

    monkeypatch.setattr(trainer, "train_step", train_step)
    monkeypatch.setattr(adam, "_fused_adam", fused_adam)
    return seen, fused_calls


def _inner(optimizer):
    from megatron_subq.training.fused_adam import inner_optimizers

    (inner,) = inner_optimizers(optimizer)
    return inner


def _plain(value):
    """A checkpoint's common state as comparable values (tensors: dtype, device, values)."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype), value.device.type, value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _fused_adam_round_trip(flags, tmp_path, monkeypatch, rel):
    """4 iterations with --subq-fused-adam give the foreach losses (within ``rel``) with torch's
    fused kernel called every step; the checkpoints saved with and without it hold the same
    tensors and the same optimizer common state (param groups' fused/foreach, the step); a
    checkpoint saved without the flag resumes with it and vice versa, each resume giving the
    uninterrupted run's losses, its param groups and steps as the resuming run's flag wants."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megatron_subq.training import pretrain

    seen, fused_calls = _spy_runs(monkeypatch)
    flags = flags + ["--train-iters", "4", "--lr", "1e-2", "--save-interval", "2"]
    on_flag = ["--subq-fused-adam"]
    off = pretrain(flags + ["--save", str(tmp_path / "off")])["iterations"]
    assert not fused_calls
    on = pretrain(flags + on_flag + ["--save", str(tmp_path / "on")])["iterations"]
    groups = len(_inner(seen[1]).param_groups)  # torch's step runs its kernel once per group
    assert fused_calls == [2] * 4 * groups  # every step of the second run, none of the first
    assert sorted(on) == sorted(off) == [1, 2, 3, 4]
    for it in off:
        assert on[it] == pytest.approx(off[it], rel=rel, abs=0), (it, on, off)
    # the same optimizer state keys in the live optimizers, and flag-independent state dicts
    a, b = (_inner(o) for o in seen)
    assert [sorted(g) for g in a.param_groups] == [sorted(g) for g in b.param_groups]
    assert [sorted(st) for st in a.state.values()] == [sorted(st) for st in b.state.values()]
    assert all(g["fused"] is True and g["foreach"] is False for g in b.param_groups)
    assert all(g["fused"] is None and g["foreach"] is None for g in a.param_groups)
    assert _plain({k: v for k, v in b.state_dict().items() if k != "state"}) == \
        _plain({k: v for k, v in a.state_dict().items() if k != "state"})
    for name in ("iter_0000002", "iter_0000004"):
        saved = [str(tmp_path / run / name) for run in ("off", "on")]
        assert sorted(load_sharded_metadata(saved[0])) == sorted(load_sharded_metadata(saved[1]))
        common = [dist_checkpointing.load_common_state_dict(f)["optimizer"] for f in saved]
        assert _plain(common[0]) == _plain(common[1])
    # resume across the flag, from iteration 2: the uninterrupted run's iterations 3 and 4
    for saved, flag, reference, fused in (("off", on_flag, off, True), ("on", [], on, False)):
        del seen[:], fused_calls[:]
        resumed = pretrain(flags + flag + ["--load", str(tmp_path / saved), "--ckpt-step", "2",
                                           "--save", str(tmp_path / f"from-{saved}")])
        assert sorted(resumed["iterations"]) == [3, 4]
        for it in (3, 4):
            assert resumed["iterations"][it] == pytest.approx(reference[it], rel=rel, abs=0)
        inner = _inner(seen[0])
        assert fused_calls == ([1] * 2 * groups if fused else [])
        assert all((g["fused"], g["foreach"]) == ((True, False) if fused else (None, None))
                   for g in inner.param_groups)
        steps = [(p, inner.state[p]["step"]) for g in inner.param_groups for p in g["params"]]
        assert all(s.dtype == torch.float32 and float(s) == 4.0 for _, s in steps)
        # where torch keeps it: the parameter's device when fused, else the CPU
        assert all(s.device == (p.device if fused else torch.device("cpu")) for p, s in steps)
        assert len({id(s) for _, s in steps}) == len(steps)  # one step tensor per parameter


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed"])
def test_fused_adam_same_losses_and_checkpoints_either_way(distributed, tmp_path, monkeypatch):
    """fp32 on the CPU (torch 2.13 fuses Adam there too): losses within 1e-6."""
    _fused_adam_round_trip(MIN + (["--use-distributed-optimizer"] if distributed else []),
                           tmp_path, monkeypatch, rel=1e-6)


def test_set_fused_adam_notes_and_refusals():
    """TE's/apex's FusedAdam is left alone with a note; an SGD or a parameter torch's fused Adam
    refuses is an error naming the flag; switching off restores the built implementation."""
    from types import SimpleNamespace

    from megatron_subq.training.fused_adam import set_fused_adam

    p = torch.nn.Parameter(torch.zeros(3))
    adam = SimpleNamespace(optimizer=torch.optim.AdamW([p]))
    assert "fused" in set_fused_adam(adam, True)
    assert adam.optimizer.param_groups[0]["fused"] is True
    assert set_fused_adam(adam, False) == ""
    assert (adam.optimizer.param_groups[0]["fused"], adam.optimizer.param_groups[0]["foreach"]) \
        == (None, None)
    apex_adam = type("FusedAdam", (torch.optim.Optimizer,), {"__module__": "apex.optimizers"})(
        [p], {})
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=apex_adam),
                                                  SimpleNamespace(optimizer=None)])
    assert "fused already: nothing changed" in set_fused_adam(chained, True)
    with pytest.raises(ValueError, match="--subq-fused-adam.*allowed: --optimizer adam"):
        set_fused_adam(SimpleNamespace(optimizer=torch.optim.SGD([p], lr=0.1)), True)
    meta = SimpleNamespace(optimizer=torch.optim.AdamW([torch.nn.Parameter(
        torch.zeros(3, device="meta"))]))
    with pytest.raises(ValueError, match="--subq-fused-adam.*on meta"):
        set_fused_adam(meta, True)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 2688])
def test_fused_rmsnorm_bf16_real_shapes_gpu(hidden):
    """The 1.3B model's activations: 8 x 2048 tokens x hidden, bf16."""
    _compare_norm((2048, 8, hidden), torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_fused_rmsnorm_bf16_zero_centered_gpu():
    _compare_norm((4096, 2, 2048), torch.bfloat16, zero_centered=True, device="cuda")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("hidden,dtype", [(8192, torch.bfloat16), (5120, torch.float16),
                                          (4096, torch.float32)])
def test_fused_rmsnorm_wide_gpu(hidden, dtype):
    _compare_norm((1023, 4, hidden), dtype, device="cuda")


@pytest.mark.slow
def test_fused_rmsnorm_more_shapes_cpu():
    for shape in ((3, 7, 1000), (64, 96), (2, 2, 2, 33)):
        _compare_norm(shape, torch.float32, zero_centered=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 8])
def test_fused_rope_bf16_real_shapes_gpu(heads):
    """The 1.3B model's queries (16 heads) and grouped keys (8): 2048 tokens x 8 rows x d 128."""
    _compare_rope(2048, 8, heads, 128, 128, torch.bfloat16, device="cuda")


@pytest.mark.gpu
def test_fusions_train_like_the_unfused_path_gpu():
    """bf16 on the GPU: every fusion on against off, 3 iterations of a small GPT."""
    from megatron_subq.training import pretrain

    flags = MIN + ["--bf16", "--hidden-size", "256", "--num-attention-heads", "8",
                   "--seq-length", "128"]
    off = pretrain(flags)["iterations"]
    on = pretrain(flags + FUSIONS + ["--cross-entropy-loss-fusion"])["iterations"]
    for it in (1, 2, 3):
        assert on[it] == pytest.approx(off[it], rel=2e-2), (it, on, off)


@pytest.mark.gpu
def test_fused_adam_round_trip_gpu(tmp_path, monkeypatch):
    """On CUDA fused Adam keeps ``step`` on the GPU: a CPU-step checkpoint resumes fused and a
    fused run's checkpoint resumes unfused (the distributed optimizer, fp32 math)."""
    _fused_adam_round_trip(MIN + ["--use-distributed-optimizer"], tmp_path, monkeypatch,
                           rel=1e-5)


def _fused_tp2_sp_against_tp1():
    """Inside 2 ranks: one step of the unfused TP=1 model, then of the fused model at TP=2 + SP
    (norm weights' partial gradients summed over TP, the fused cross-entropy's all-reduce)."""
    from megatron_subq.testing.distributed import reinit_parallel
    from megatron_subq.testing.equivalence import tiny_gpt_step

    fused = dict(subq_fused_norm=True, subq_fused_rope=True, bias_activation_fusion=True,
                 bias_dropout_fusion=True, qk_layernorm=True)
    reinit_parallel(tp=1)
    ref = tiny_gpt_step({"qk_layernorm": True})
    reinit_parallel(tp=2)
    out = tiny_gpt_step({**fused, "sequence_parallel": True})
    return ref, out


@pytest.mark.slow
def test_fused_tp2_sp_matches_unfused_tp1():
    from megatron_subq.testing import run_distributed

    close = dict(rtol=1e-4, atol=1e-5)  # tests/test_parallel_equivalence.py's TP=2 bounds
    for ref, out in run_distributed(_fused_tp2_sp_against_tp1, 2, tp=1):
        torch.testing.assert_close(out["loss"], ref["loss"], **close)
        torch.testing.assert_close(out["logits"], ref["logits"], **close)
        assert sorted(out["grads"]) == sorted(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(out["grads"][name], g, **close, msg=name)
