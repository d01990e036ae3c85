"""Decoding with each variant's own cache equals one full forward pass; generation.

Every variant that decodes (``Variant.decode_cache`` != "none"), on the GPT host and in a
``layer_pattern="hybrid"`` mix, and the hybrid host (Mamba-2 + attention slots): a prompt
prefilled, then token by token, gives the logits of ``full_logits`` on the whole sequence, and a
chunked prefill the same; recurrent variants keep a constant-size state. ``generate``: greedy is
deterministic, sampling reproducible with a seed, prompts of different lengths each equal to
their own run, TP=2 equal to TP=1; tools/generate.py end to end; the refusals.
"""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import megatron_subq as subq  # noqa: E402
from megatron_subq.inference import (  # noqa: E402
    DecodeSession,
    check_decodable,
    full_logits,
    generate,
)
from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.testing.cases import (  # noqa: E402
    VARIANT_TEST_SETTINGS,
    variant_test_settings,
)
from megatron_subq.variants import VARIANTS  # noqa: E402

VOCAB = 96
DECODING = sorted(n for n, v in VARIANTS.items() if v.decode_cache != "none")
# approx divides by q~ . sum k~, which has no sign: near-zero denominators amplify fp32 rounding
ATOL = {"approx": 1e-4}


@pytest.fixture
def one_process():
    subq.init_single_process()
    yield
    # the parallel state stays for the next test; the module's last test tears it down


@pytest.fixture(scope="module", autouse=True)
def _teardown_world():
    yield
    subq.destroy_single_process()


def _gpt(name=None, seed=0, **overrides):
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  use_cpu_initialization=True)
    if name is not None:
        kwargs.update(variant_test_settings(name))
    kwargs.update(overrides)
    if kwargs.get("attention_variant") == "sas":
        kwargs.pop("num_query_groups")
    torch.manual_seed(seed)
    return subq.build_gpt_model(subq.SubqTransformerConfig(**kwargs), vocab_size=VOCAB,
                                max_sequence_length=64)


def _tokens(batch=2, length=18, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _decoded_logits(model, tokens, prompt=5, chunk=None):
    """Logits of every position: ``prompt`` tokens prefilled (in ``chunk``s), then one by one."""
    session = DecodeSession(model, tokens.shape[0], tokens.shape[1] + 2)
    first = session.prefill(tokens[:, :prompt], chunk=chunk, all_logits=True)
    steps = [session.step(tokens[:, t]) for t in range(prompt, tokens.shape[1])]
    return torch.cat([first, torch.stack(steps, dim=1)], dim=1), session


def _assert_decode_equals_full(model, name, tokens=None):
    tokens = _tokens() if tokens is None else tokens
    ref = full_logits(model, tokens)
    got, session = _decoded_logits(model, tokens)
    atol = ATOL.get(name, 2e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=atol, msg=f"{name}: step by step")
    session.reset()
    chunked = session.prefill(tokens, chunk=5, all_logits=True)
    torch.testing.assert_close(chunked, ref, rtol=1e-5, atol=atol, msg=f"{name}: chunked prefill")
    return session


def test_cache_ops_equal_the_full_ops_rows():
    """``standard_prefill`` / ``ppa_prefill``: a chunk of queries in the middle of a longer cache
    (GQA, PPA's far offsets reached) gives those rows of the full op."""
    from megatron_subq import ops

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    cache_k = torch.cat([k[:, :30], torch.full_like(k[:, 30:], float("nan"))], dim=1)
    cache_v = torch.cat([v[:, :30], torch.full_like(v[:, 30:], float("nan"))], dim=1)
    for impl in ("reference", None):
        full = ops.standard_attention(q, k, v, impl=impl)
        got = ops.standard_prefill(q[:, 21:30], cache_k, cache_v, start=21, impl=impl)
        torch.testing.assert_close(got, full[:, 21:30])
        one = ops.standard_prefill(q[:, 29:30], k[:, :30], v[:, :30], impl=impl)  # start = L - 1
        torch.testing.assert_close(one, full[:, 29:30])
        # one decode step mid-cache (the grouped-query path: NaN rows past it are never read)
        step = ops.standard_prefill(q[:, 21:22], cache_k, cache_v, start=21, impl=impl)
        torch.testing.assert_close(step, full[:, 21:22])
    full = ops.ppa_attention(q, k, v, 0.5, 2, impl="reference")
    got = ops.ppa_prefill(q[:, 21:30], cache_k, cache_v, 0.5, 2, start=21)
    torch.testing.assert_close(got, full[:, 21:30])
    with pytest.raises(ValueError, match=r"start=35 is invalid: allowed an integer in \[0, 31\]"):
        ops.ppa_prefill(q[:, 21:30], cache_k, cache_v, 0.5, 2, start=35)
    with pytest.raises(ValueError, match="start=-1"):
        ops.standard_prefill(q[:, :2], k, v, start=-1)


@pytest.mark.parametrize("name", DECODING)
def test_every_decoding_variant_equals_its_full_forward(one_process, name):
    session = _assert_decode_equals_full(_gpt(name), name)
    caches = session.context.key_value_memory_dict
    if VARIANTS[name].decode_cache == "state":  # O(1) per token: nothing sized by the length
        assert caches and all(not hasattr(c, "k") for c in caches.values()), name
    elif VARIANTS[name].decode_cache == "kv":
        assert all(c.k.shape[1] == session.max_length for c in caches.values()), name
    else:
        assert not caches, name


def test_hybrid_layer_pattern_mix_decodes(one_process):
    model = _gpt("superlinear", num_layers=4, layer_pattern="hybrid")
    assert model.config.layer_variants == ["superlinear", "standard"] * 2
    _assert_decode_equals_full(model, "hybrid pattern")


def test_hybrid_host_decodes_with_mamba_states(one_process):
    from megatron_subq.hybrid import build_hybrid_model
    from megatron_subq.testing.hybrid import hybrid_test_config

    config = hybrid_test_config(hybrid_override_pattern="M*-M*", num_layers=5,
                                layer_pattern=["superlinear", "standard"])
    torch.manual_seed(0)
    model = build_hybrid_model(config, vocab_size=VOCAB, max_sequence_length=64)
    session = _assert_decode_equals_full(model, "hybrid host")
    kinds = {type(c).__name__ for c in session.context.key_value_memory_dict.values()}
    # Mamba (conv, ssm) states and the attention caches (superlinear's: a KVCache subclass that
    # also keeps its captured decode step)
    assert kinds == {"tuple", "KVCache", "SuperlinearKVCache"}


def test_megatron_mamba_mixer_takes_one_prefill_only(one_process):
    """megatron's MambaMixer decodes one token per forward once its states exist: with it in the
    model, a chunked or later prefill is refused before anything runs (a stand-in subclass of
    megatron's class marks the layers here: the real one needs CUDA and mamba_ssm)."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_subq.hybrid import build_hybrid_model
    from megatron_subq.inference import DecodeSession
    from megatron_subq.ssm.mamba_mixer import SubqMambaMixer
    from megatron_subq.testing.hybrid import hybrid_test_config

    config = hybrid_test_config(hybrid_override_pattern="M*-M*", num_layers=5,
                                layer_pattern=["superlinear", "standard"])
    torch.manual_seed(0)
    model = build_hybrid_model(config, vocab_size=VOCAB, max_sequence_length=64)
    assert not DecodeSession(model, 2, 32).one_prefill_only  # the PyTorch mixer chunks
    mixers = [m for m in model.modules() if isinstance(m, SubqMambaMixer)]
    assert mixers
    mixers[0].__class__ = type("MegatronMixerStandIn", (SubqMambaMixer, MambaMixer), {})
    session = DecodeSession(model, 2, 32)
    assert session.one_prefill_only
    tokens = _tokens(length=12)
    with pytest.raises(ValueError, match=r"chunk=4 for 12 tokens after 0 positions.*MambaMixer"):
        session.prefill(tokens, chunk=4)
    assert session.length == 0  # nothing ran
    mixers[0].__class__ = SubqMambaMixer  # the whole prompt at position 0, then no more prefill
    session.prefill(tokens)
    mixers[0].__class__ = type("MegatronMixerStandIn", (SubqMambaMixer, MambaMixer), {})
    with pytest.raises(ValueError, match=r"after 12 positions"):
        session.prefill(tokens[:, :2])


def test_generate_greedy_sampled_and_ragged_prompts(one_process):
    model = _gpt("asa", layer_pattern="hybrid")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7]]
    greedy = generate(model, prompts, 6)
    assert [len(g) for g in greedy] == [6, 6, 6]
    assert generate(model, prompts, 6) == greedy
    # each prompt of the batch decodes as it would alone (no padding enters its cache)
    assert [generate(model, [p], 6)[0] for p in prompts] == greedy
    # greedy = argmax of the full forward at every new position
    seq = torch.tensor([prompts[0] + greedy[0]])
    ref = full_logits(model, seq)[0, len(prompts[0]) - 1:-1].argmax(-1).tolist()
    assert ref == greedy[0]
    assert generate(model, prompts, 6, prefill_chunk=2) == greedy
    sampled = generate(model, prompts, 6, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    assert generate(model, prompts, 6, temperature=1.0, top_k=20, top_p=0.9, seed=3) == sampled
    assert sampled != generate(model, prompts, 6, temperature=1.0, seed=4)
    # eos: a sequence stops after it (included)
    eos = greedy[0][2]
    stopped = generate(model, prompts[:1], 6, eos_id=eos)[0]
    assert stopped == greedy[0][:greedy[0].index(eos) + 1]
    assert all(t < 50 for row in generate(model, prompts, 6, temperature=2.0, seed=0,
                                          vocab_size=50) for t in row)


def test_refusals_name_the_variant_and_the_setting(one_process):
    model = _gpt("static_emb_qk")
    with pytest.raises(ValueError, match="'static_emb_qk' cannot generate: its queries/keys"):
        generate(model, [[1, 2]], 2)
    model = _gpt("standard")
    model.config.pipeline_model_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2"):
        check_decodable(model)
    model.config.pipeline_model_parallel_size = 1
    model.config.context_parallel_size = 2
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        generate(model, [[1, 2]], 2)
    model.config.context_parallel_size = 1
    for bad, needle in (({"max_new_tokens": -1}, "max_new_tokens"),
                        ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                        ({"prompts": [[]]}, "prompts"), ({"prefill_chunk": 0}, "prefill_chunk"),
                        ({"vocab_size": 4}, "vocab_size")):
        kwargs = {"prompts": [[1, 5]], "max_new_tokens": 2, **bad}
        with pytest.raises(ValueError, match=needle):
            generate(model, **kwargs)
    session = DecodeSession(model, 1, 4)
    with pytest.raises(ValueError, match="max_length=4"):
        session.prefill(torch.tensor([[1, 2, 3, 4, 5]]))


def _tp_generation(layer_pattern):
    """Greedy and seeded sampled generation, and decoded logits, at TP=2 then at TP=1 (same
    weights: use_cpu_initialization draws full tensors), in one 2-rank world."""
    from megatron_subq.testing.distributed import reinit_parallel

    knobs = {}
    for name in layer_pattern:
        knobs.update(VARIANT_TEST_SETTINGS[name])
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    out = {}
    for tp in (2, 1):
        reinit_parallel(tp=tp)
        torch.manual_seed(0)
        config = subq.SubqTransformerConfig(
            num_layers=len(layer_pattern), hidden_size=64, num_attention_heads=4,
            use_cpu_initialization=True, tensor_model_parallel_size=tp,
            layer_pattern=list(layer_pattern), **knobs)
        model = subq.build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=64)
        tokens = _tokens(length=10)
        out[tp] = dict(greedy=generate(model, prompts, 5),
                       sampled=generate(model, prompts, 5, temperature=1.0, top_p=0.9, seed=7),
                       logits=_decoded_logits(model, tokens)[0], full=full_logits(model, tokens))
    return out


@pytest.mark.slow  # one 2-process launch: ~15-20 s on two CPU cores
def test_tp2_generation_equals_tp1():
    layers = ("sas", "superlinear", "asa", "ppa", "nonapprox")
    results = run_distributed(_tp_generation, 2, tp=2, args=(layers,))
    for rank in results:
        tp2, tp1 = rank[2], rank[1]
        assert tp2["greedy"] == tp1["greedy"] and tp2["sampled"] == tp1["sampled"]
        torch.testing.assert_close(tp2["logits"], tp2["full"], rtol=1e-5, atol=2e-5)
        torch.testing.assert_close(tp2["logits"], tp1["logits"], rtol=1e-4, atol=1e-4)
    assert results[0][2]["sampled"] == results[1][2]["sampled"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from megatron_subq.training import pretrain

    save = str(tmp_path_factory.mktemp("generate") / "ckpt")
    pretrain(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--attention-variant", "nonapprox", "--seq-length", "16",
              "--max-position-embeddings", "32", "--micro-batch-size", "2",
              "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
              "--eval-iters", "0", "--num-workers", "0", "--save", save,
              "--save-interval", "1"])
    return save


def test_tool_generates_from_a_checkpoint(tiny_checkpoint, tmp_path, capsys):
    from tools.generate import main

    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "7 8 9 10"}) + "\n")
    output = tmp_path / "out.jsonl"
    records = main(["--load", tiny_checkpoint, "--prompt", "1 2 3", "--prompt-file",
                    str(prompt_file), "--max-new-tokens", "4", "--prefill-chunk", "2",
                    "--ignore-eos", "--output", str(output)])
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt"] for r in lines] == ["1 2 3", "7 8 9 10"] and lines == records
    assert all(len(r["tokens"]) == 4 and all(0 <= t < VOCAB for t in r["tokens"])
               for r in lines)
    assert lines[0]["completion"] == " ".join(str(t) for t in lines[0]["tokens"])
    assert "1 2 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--load", tiny_checkpoint, "--max-new-tokens", "2"])  # no prompt


@pytest.mark.gpu
@pytest.mark.parametrize("name", DECODING)
def test_decode_equals_full_forward_on_gpu(one_process, name):
    """On a GPU, the variants' kernels (where they have one) in bf16: prefill + token-by-token
    decoding gives the full forward's logits within bf16 rounding, and greedy generation runs."""
    model = _gpt(name, subq_impl=None, bf16=True,  # subq_impl=None: the kernels where they exist
                 params_dtype=torch.bfloat16).cuda()
    tokens = _tokens(length=40).cuda()
    ref = full_logits(model, tokens)
    got, _ = _decoded_logits(model, tokens, prompt=17)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 3e-2, f"{name}: decode vs full forward relative error {err:.3g}"
    out = generate(model, [tokens[0, :9].tolist()], 6)
    assert len(out[0]) == 6
