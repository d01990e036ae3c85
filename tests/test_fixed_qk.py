"""rnd_emb_qk, fixed_seq_qk, static_emb_qk: the shared-map op, config, semantics, cost, training.

The semantic checks compare against standard attention with the *same weights* (the variant's
``linear_qk``/``linear_v`` fused into megatron's ``linear_qkv`` layout) where the definitions
coincide with it:

* fixed_seq_qk on an input that *is* the fixed text, and rnd_emb_qk on an input embedding that
  *is* ε: the fixed row and the real row are the same tensor at every layer, so Q/K from the fixed
  row are the sample's own — standard attention. Logits and every weight gradient must match;
  the gradients only match if the Q/K gradient flows back through the fixed row's path.
* static_emb_qk with one layer: the layer's input is the embedding output.

Model-building checks run in one spawned single-rank world (megatron needs its parallel state);
TP/SP/PP equivalence of each variant is in test_parallel_equivalence.py, plus one mixed model
here whose three streams cross a pipeline boundary together.
"""

import os

import numpy as np
import pytest
import torch

import megatron_subq as subq
from megatron_subq import ops
from megatron_subq.model import StreamLayout, stream_layout
from megatron_subq.testing import run_distributed
from megatron_subq.testing.equivalence import (TINY, fit_repeating_batch, make_batch,
                                               tiny_gpt_pipeline_losses, tiny_gpt_step)
from megatron_subq.variants.fixed_seq_qk import load_fixed_tokens

TOKENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fixed_qk_tokens.txt")
BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2)
VOCAB, SEQ = 128, 16


# ------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,H,H_kv", [(1, 5, 4, 4), (3, 9, 4, 2), (2, 12, 6, 1)])
def test_shared_map_op_is_the_definition(B, T, H, H_kv):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, T, H, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, T, H_kv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, T, H_kv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, T, H, 8, generator=g, dtype=torch.float64)
    shared = ops.shared_map_attention(q, k, v)
    grads = torch.autograd.grad((shared * w).sum(), (q, k, v))
    # the definition: ordinary causal attention with q, k repeated for every sample
    expand = (B, -1, -1, -1)
    ref = ops.standard_attention(q.expand(expand), k.expand(expand), v, impl="reference")
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(shared, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.shared_map_attention(q, k, v, impl="reference"), ref)


def test_shared_map_op_keeps_one_half_precision_map():
    """Activation memory: the [H, T, T] map is saved once, in the value dtype (2 bytes/entry)."""
    H, T = 4, 32
    q = torch.randn(1, T, H, 8, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, T, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(3, T, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(t):
        if t.is_floating_point() and t.numel() >= H * T * T:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ops.shared_map_attention(q, k, v)
    assert sum(saved.values()) == 2 * H * T * T, saved
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_shared_map_op_rejects_bad_input():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"q must have shape \[1, T, H, D\]"):
        ops.shared_map_attention(q.expand(2, -1, -1, -1), q, q.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match=r"k must have shape \[1, T, H, D\]"):
        ops.shared_map_attention(q, q.expand(2, -1, -1, -1), q)
    with pytest.raises(ValueError, match="v must have shape"):
        ops.shared_map_attention(q, q, q[0])
    with pytest.raises(ValueError, match="must share"):
        ops.shared_map_attention(q, q, torch.randn(3, 5, 2, 8))
    with pytest.raises(ValueError, match="impl="):
        ops.shared_map_attention(q, q, q, impl="fast")


# ------------------------------------------------------------------------------------------
# config and the stream layout
# ------------------------------------------------------------------------------------------
def test_token_file_formats(tmp_path):
    ids = load_fixed_tokens(TOKENS)
    assert ids.dtype == torch.long and ids.shape == (64,) and int(ids.max()) < VOCAB
    npy = tmp_path / "t.npy"
    np.save(npy, np.array([5, 0, 7], dtype=np.int32))
    assert load_fixed_tokens(str(npy)).tolist() == [5, 0, 7]
    txt = tmp_path / "t.txt"
    txt.write_text("5 0\n7\t9\n")
    assert load_fixed_tokens(str(txt)).tolist() == [5, 0, 7, 9]


@pytest.mark.parametrize("content,needle", [
    (None, "fixed_qk_tokens_file=None is invalid"),
    ("missing", "no such file"),
    ("1 2 x 4", "entry 2 is 'x'"),
    ("1 2.5", "entry 1 is '2.5'"),
    ("  \n", "holds no tokens"),
    ("3 -1", "negative token id"),
    (np.zeros((2, 2), dtype=np.int64), "allowed a 1-D integer array"),
    (np.zeros(3, dtype=np.float32), "allowed a 1-D integer array"),
])
def test_config_rejects_bad_token_files(tmp_path, content, needle):
    if content is None:
        path = None
    elif isinstance(content, np.ndarray):
        path = str(tmp_path / "bad.npy")
        np.save(path, content)
    elif content == "missing":
        path = str(tmp_path / "nope.txt")
    else:
        path = str(tmp_path / "bad.txt")
        with open(path, "w") as f:
            f.write(content)
    with pytest.raises(ValueError) as err:
        subq.SubqTransformerConfig(**BASE, attention_variant="fixed_seq_qk",
                                   fixed_qk_tokens_file=path)
    assert needle in str(err.value) and "fixed_qk_tokens_file" in str(err.value), str(err.value)
    # the file is only required where a fixed_seq_qk layer is used
    subq.SubqTransformerConfig(**BASE, attention_variant="rnd_emb_qk", fixed_qk_tokens_file=path)


@pytest.mark.parametrize("kwargs,needle", [
    ({"attention_variant": "rnd_emb_qk", "fixed_qk_seed": -1}, "fixed_qk_seed=-1"),
    ({"attention_variant": "rnd_emb_qk", "fixed_qk_seed": "7"}, "fixed_qk_seed='7'"),
    ({"attention_variant": "static_emb_qk", "num_query_groups": 1,
      "tensor_model_parallel_size": 2}, "num_query_groups=1"),
    ({"attention_variant": "static_emb_qk", "attention_output_gate": True},
     "attention_output_gate=True"),
])
def test_config_rejects_bad_knobs(kwargs, needle):
    with pytest.raises(ValueError) as err:
        subq.SubqTransformerConfig(**{**BASE, **kwargs})
    assert needle in str(err.value) and "allowed" in str(err.value), str(err.value)


def test_pipeline_parallel_sends_shapes():
    """The packed hidden states are [s, b + extra, h]: PP needs megatron's shape exchange."""
    pp = dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    for name in ("rnd_emb_qk", "static_emb_qk"):
        assert subq.SubqTransformerConfig(**BASE, **pp, attention_variant=name).variable_seq_lengths
    assert not subq.SubqTransformerConfig(**BASE, **pp).variable_seq_lengths
    no_pp = subq.SubqTransformerConfig(**BASE, attention_variant="rnd_emb_qk")
    assert not no_pp.variable_seq_lengths


def test_stream_layout_carries_each_stream_to_its_last_consumer():
    cfg = subq.SubqTransformerConfig(
        **{**BASE, "num_layers": 5, "fixed_qk_tokens_file": TOKENS,
           "layer_pattern": ["static_emb_qk", "rnd_emb_qk", "standard", "fixed_seq_qk",
                             "standard"]})
    both = ("rnd_emb_qk", "fixed_seq_qk")
    assert stream_layout(cfg, 1) == StreamLayout(both, True)
    assert stream_layout(cfg, 2) == StreamLayout(both, False)
    assert stream_layout(cfg, 3) == stream_layout(cfg, 4) == StreamLayout(("fixed_seq_qk",), False)
    assert stream_layout(cfg, 5).empty and stream_layout(cfg, 6).empty
    assert StreamLayout(both, True).real_batch(2 * (3 + 2)) == 3
    assert StreamLayout(("rnd_emb_qk",), False).real_batch(4) == 3
    with pytest.raises(ValueError, match="does not fit"):
        StreamLayout(both, True).real_batch(5)
    # the skip ablation removes every consumer, so nothing is carried
    cfg.skip_variant_layers = True
    assert stream_layout(cfg, 1).empty


# ------------------------------------------------------------------------------------------
# semantics and cost, in one spawned single-rank world
# ------------------------------------------------------------------------------------------
def _build(**kwargs):
    max_seq = kwargs.pop("max_sequence_length", SEQ)
    cfg = subq.SubqTransformerConfig(**{**TINY, "fixed_qk_tokens_file": TOKENS, **kwargs})
    return subq.build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=max_seq)


def _fuse_qkv(qk: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """linear_qk [ng·(G+1)·hn, h] + linear_v [ng·hn, h] -> megatron's linear_qkv layout."""
    h = qk.shape[-1]
    return torch.cat([qk.view(groups, -1, h), v.view(groups, -1, h)], dim=1).reshape(-1, h)


def _standard_twin(model, **kwargs):
    """A standard-attention GPT with ``model``'s weights (Q/K/V fused into linear_qkv)."""
    std = _build(**{**kwargs, "attention_variant": "standard", "layer_pattern": None})
    ours = dict(model.named_parameters())
    groups = model.config.num_query_groups
    with torch.no_grad():
        for name, p in std.named_parameters():
            if name in ours:
                p.copy_(ours[name])
            else:
                prefix = name[:-len("linear_qkv.weight")]
                p.copy_(_fuse_qkv(ours[prefix + "linear_qk.weight"],
                                  ours[prefix + "linear_v.weight"], groups))
    return std


def _grads_as_standard(model) -> dict:
    ours = {n: p.grad for n, p in model.named_parameters()}
    groups = model.config.num_query_groups
    out = {}
    for name, g in ours.items():
        if name.endswith("linear_qk.weight"):
            prefix = name[:-len("linear_qk.weight")]
            out[prefix + "linear_qkv.weight"] = _fuse_qkv(g, ours[prefix + "linear_v.weight"],
                                                          groups)
        elif not name.endswith("linear_v.weight"):
            out[name] = g
    return out


def _max_diff(a: dict, b: dict) -> float:
    """Max |a - b| over named gradients; a gradient missing on one side only is a failure."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    assert all((a[n] is None) == (b[n] is None) for n in a), "different parameters got gradients"
    return max((a[n] - b[n]).abs().max().item() for n in a if a[n] is not None)


def _same_as_standard(model, std, *inputs, **kw) -> dict:
    """Max |difference| of loss and of every weight gradient between ``model`` and ``std``."""
    loss = model(*inputs, **kw).mean()
    loss.backward()
    std_loss = std(*inputs, **kw).mean()
    std_loss.backward()
    return {"loss": abs(loss.item() - std_loss.item()),
            "grads": _max_diff(_grads_as_standard(model),
                               {n: p.grad for n, p in std.named_parameters()})}


def _capture_qk(model) -> list:
    """Record (q, k, v) at every QK-source layer's core attention, in call order."""
    from megatron_subq.variants.qk_source import QKSourceAttention

    seen = []
    for module in model.modules():
        if isinstance(module, QKSourceAttention):
            module.core_attention.register_forward_pre_hook(
                lambda _m, args: seen.append(tuple(a.detach().clone() for a in args[:3])))
    return seen


def semantic_checks() -> dict:
    """Everything that needs a built model; numbers come back to the parent's asserts."""
    torch.manual_seed(0)
    r = {}
    text = load_fixed_tokens(TOKENS)
    pos = torch.arange(SEQ).unsqueeze(0)
    labels = torch.roll(text[:SEQ], -1).unsqueeze(0)

    # fixed_seq_qk on the fixed text itself == standard attention, weights and gradients
    model = _build(attention_variant="fixed_seq_qk")
    std = _standard_twin(model)
    r["fixed_seq_vs_standard"] = _same_as_standard(model, std, text[:SEQ].unsqueeze(0), pos, None,
                                                   labels=labels)
    # ... and sample 0 keeps that output when another sample shares the batch
    tokens = torch.stack([text[:SEQ], make_batch(VOCAB, 1, SEQ, seed=3)[0][0]])
    with torch.no_grad():
        both = model(tokens, pos.expand(2, SEQ), None)
        alone = std(text[:SEQ].unsqueeze(0), pos, None)
    r["fixed_seq_batch_independent"] = (both[:1] - alone).abs().max().item()

    # rnd_emb_qk fed ε itself as its input embedding == standard attention on ε
    model = _build(attention_variant="rnd_emb_qk")
    std = _standard_twin(model)
    eps = model.fixed_qk_noise[:SEQ].unsqueeze(1).clone()  # [s, 1, h]
    r["rnd_vs_standard"] = _same_as_standard(model, std, None, None, None, decoder_input=eps,
                                             labels=labels)
    assert not model.fixed_qk_noise.requires_grad  # ε is never trained
    r["noise_persistent"] = "fixed_qk_noise" in model.state_dict()
    r["noise_std"] = model.fixed_qk_noise.std().item()

    # rnd_emb_qk: one map for the batch, independent of the input and of the other samples
    seen = _capture_qk(model)
    tok_a, _, pos3 = make_batch(VOCAB, 3, SEQ, seed=1)
    tok_b, _, _ = make_batch(VOCAB, 3, SEQ, seed=2)
    with torch.no_grad():
        out_a = model(tok_a, pos3, None)
        model(tok_b, pos3, None)
        singles = torch.cat([model(tok_a[i:i + 1], pos3[:1], None) for i in range(3)])
    n_layers = model.config.num_layers
    first, second = seen[:n_layers], seen[n_layers:2 * n_layers]
    r["rnd_qk_batch"] = [q.shape[1] for q, _, _ in first] + [k.shape[1] for _, k, _ in first]
    r["rnd_v_batch"] = [v.shape[1] for _, _, v in first]
    r["rnd_qk_input_dependence"] = max(
        max((q1 - q2).abs().max().item(), (k1 - k2).abs().max().item())
        for (q1, k1, _), (q2, k2, _) in zip(first, second))
    r["rnd_batch_independent"] = (out_a - singles).abs().max().item()

    # fixed rows are computed once per micro-batch: every layer sees b + 1 rows, not 2b
    shapes = []
    hybrid = _build(attention_variant="rnd_emb_qk", layer_pattern="hybrid", num_layers=4)
    for layer in hybrid.decoder.layers:
        layer.mlp.register_forward_pre_hook(lambda _m, args: shapes.append(args[0].shape[1]))
    with torch.no_grad():
        hybrid(tok_a, pos3, None)
    r["hybrid_mlp_rows"] = shapes  # layers 1-3 carry the fixed row, layer 4 (standard) does not

    # a different seed, a different ε, a different model
    with torch.no_grad():
        other = _build(attention_variant="rnd_emb_qk", fixed_qk_seed=99)
        other.load_state_dict(model.state_dict())
        r["seed_changes_output"] = (other(tok_a, pos3, None) - out_a).abs().max().item()

    # a shorter sequence sees the prefix of the fixed input (causality): logits are the prefix
    for name in ("rnd_emb_qk", "fixed_seq_qk"):
        long_model = _build(attention_variant=name, max_sequence_length=2 * SEQ)
        tok, _, p = make_batch(VOCAB, 2, 2 * SEQ, seed=4)
        with torch.no_grad():
            full = long_model(tok, p, None)
            short = long_model(tok[:, :SEQ], p[:, :SEQ], None)
        r[f"{name}_prefix"] = (full[:, :SEQ] - short).abs().max().item()

    # static_emb_qk with one layer: the layer's input is the embedding output -> standard
    one = _build(attention_variant="static_emb_qk", num_layers=1)
    std = _standard_twin(one, num_layers=1)
    r["static_vs_standard"] = _same_as_standard(one, std, tok_a, pos3, None, labels=tok_b)
    # with two layers, layer 2's Q/K depend on the embeddings only, not on layer 1
    model = _build(attention_variant="static_emb_qk")
    seen = _capture_qk(model)
    with torch.no_grad():
        model(tok_a, pos3, None)
        for p in model.decoder.layers[0].parameters():
            p.add_(0.5 * torch.randn_like(p))
        model(tok_a, pos3, None)
    r["static_layer2_q_vs_layer1"] = (seen[1][0] - seen[3][0]).abs().max().item()
    r["static_layer2_v_vs_layer1"] = (seen[1][2] - seen[3][2]).abs().max().item()
    r["static_qk_batch"] = seen[0][0].shape[1]

    # parameter-matched: exactly the weights of standard attention
    for name in ("rnd_emb_qk", "fixed_seq_qk", "static_emb_qk"):
        r[f"params_{name}"] = sum(p.numel() for p in _build(attention_variant=name).parameters())
    r["params_standard"] = sum(p.numel() for p in _build().parameters())

    # errors: a sequence longer than the fixed text; a text that is too short or out of vocab
    errors = {}
    long_model = _build(attention_variant="fixed_seq_qk", max_sequence_length=64)
    try:
        long_model.fixed_input("fixed_seq_qk", 65)
    except ValueError as e:
        errors["seq_longer_than_text"] = str(e)
    for key, kwargs in (("text_too_short", {"max_sequence_length": 65}),
                        ("text_out_of_vocab", {})):
        try:
            cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": "fixed_seq_qk",
                                                "fixed_qk_tokens_file": TOKENS})
            subq.build_gpt_model(cfg, vocab_size=VOCAB if kwargs else 100,
                                 max_sequence_length=kwargs.get("max_sequence_length", SEQ))
        except ValueError as e:
            errors[key] = str(e)
    r["errors"] = errors
    return r


@pytest.fixture(scope="module")
def semantics():
    return run_distributed(semantic_checks, 1, tp=1)[0]


def test_fixed_text_input_is_standard_attention(semantics):
    assert semantics["fixed_seq_vs_standard"]["loss"] < 1e-5
    # equal gradients: Q/K gradients flow back through the fixed row into every lower layer
    assert semantics["fixed_seq_vs_standard"]["grads"] < 1e-5
    assert semantics["fixed_seq_batch_independent"] < 1e-5


def test_noise_input_is_standard_attention(semantics):
    assert semantics["rnd_vs_standard"]["loss"] < 1e-5
    assert semantics["rnd_vs_standard"]["grads"] < 1e-5
    assert not semantics["noise_persistent"]  # rebuilt from fixed_qk_seed, not checkpointed
    assert 0.015 < semantics["noise_std"] < 0.025  # init_method_std


def test_one_input_independent_map_for_the_batch(semantics):
    assert semantics["rnd_qk_batch"] == [1, 1, 1, 1]  # q, k of the fixed row only
    assert semantics["rnd_v_batch"] == [4, 4]  # v of the 3 samples and the fixed row
    assert semantics["rnd_qk_input_dependence"] == 0.0
    assert semantics["rnd_batch_independent"] < 1e-5
    assert semantics["seed_changes_output"] > 1e-3


def test_fixed_row_costs_one_row_per_micro_batch(semantics):
    assert semantics["hybrid_mlp_rows"] == [4, 4, 4, 3]


def test_shorter_sequences_use_the_fixed_prefix(semantics):
    assert semantics["rnd_emb_qk_prefix"] < 1e-5
    assert semantics["fixed_seq_qk_prefix"] < 1e-5


def test_static_embeddings_feed_q_and_k(semantics):
    assert semantics["static_vs_standard"]["loss"] < 1e-5
    assert semantics["static_vs_standard"]["grads"] < 1e-5
    assert semantics["static_layer2_q_vs_layer1"] == 0.0  # Q/K: embeddings only
    assert semantics["static_layer2_v_vs_layer1"] > 1e-3  # V: the layer's input
    assert semantics["static_qk_batch"] == 3


def test_parameter_matched(semantics):
    for name in ("rnd_emb_qk", "fixed_seq_qk", "static_emb_qk"):
        assert semantics[f"params_{name}"] == semantics["params_standard"]


def test_length_and_vocab_errors(semantics):
    errors = semantics["errors"]
    assert "longer than the fixed text" in errors["seq_longer_than_text"]
    assert "fewer than max_sequence_length=65" in errors["text_too_short"]
    assert "vocab_size=100" in errors["text_out_of_vocab"]


# ------------------------------------------------------------------------------------------
# training, and all three streams across TP+SP / a pipeline boundary at once
# ------------------------------------------------------------------------------------------
def train_hybrids(steps: int) -> dict:
    """A 2-layer hybrid (variant, standard) of each variant, Adam on a repeating sequence."""
    losses = {}
    for name in ("rnd_emb_qk", "fixed_seq_qk", "static_emb_qk"):
        torch.manual_seed(0)
        cfg = subq.SubqTransformerConfig(**{**TINY, "attention_variant": name,
                                            "layer_pattern": "hybrid",
                                            "fixed_qk_tokens_file": TOKENS})
        model = subq.build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=32)
        losses[name] = fit_repeating_batch(model, steps)
    return losses


def test_hybrids_train_with_falling_loss():
    for name, losses in run_distributed(train_hybrids, 1, tp=1, args=(30,))[0].items():
        assert all(np.isfinite(losses)), name
        assert losses[-1] < 0.6 * losses[0], (name, losses)


MIXED = {"num_layers": 4, "fixed_qk_tokens_file": TOKENS,
         "layer_pattern": ["static_emb_qk", "rnd_emb_qk", "fixed_seq_qk", "static_emb_qk"]}


def test_mixed_streams_tp2_sp_equals_tp1():
    ref = run_distributed(tiny_gpt_step, 1, tp=1, args=(MIXED,))[0]
    for rank in run_distributed(tiny_gpt_step, 2, tp=2, args=({**MIXED,
                                                               "sequence_parallel": True},)):
        torch.testing.assert_close(rank["logits"], ref["logits"], rtol=1e-4, atol=1e-5)
        assert set(rank["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(rank["grads"][name], g, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")


def test_mixed_streams_cross_a_pipeline_boundary():
    # stage 1 = layers 1-2, stage 2 = layers 3-4: the text row and the embeddings are sent along
    ref = run_distributed(tiny_gpt_pipeline_losses, 1, tp=1, pp=1, args=(MIXED,))[0]
    last = run_distributed(tiny_gpt_pipeline_losses, 2, tp=1, pp=2, args=(MIXED,))[-1]
    assert len(last) == len(ref) > 0
    for a, b in zip(last, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
