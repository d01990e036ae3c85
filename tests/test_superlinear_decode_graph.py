"""``superlinear_decode_graph``: generation's one-token superlinear steps through a
``SuperlinearDecodePlan`` (captured in a CUDA graph per layer and capacity bucket on a GPU).

* CPU (the plan uncaptured, its kernels in Triton's interpreter): decoding a tiny GPT whose
  layers are all superlinear, across a capacity bucket boundary (16 -> 32), gives the eager step's
  logits bitwise at every position and the same greedy tokens; one plan per layer and bucket
  (the plan is rebuilt when the length enters the next bucket, and dropped with the session).
* The switch: a bad value, or the reference implementation, is a ValueError naming the field;
  the trainer flag ``--superlinear-decode-graph``; the eager step stays the default.
* GPU (``gpu``-marked): a bf16 hybrid-width model generates the same tokens and logits with the
  graph on and off, across a bucket boundary; each layer captures once per bucket and replays
  at the other steps of it.
"""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 first on the CPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import megatron_subq as subq  # noqa: E402
from megatron_subq.inference import DecodeSession, generate  # noqa: E402
from megatron_subq.testing.cases import variant_test_settings  # noqa: E402
from megatron_subq.variants.superlinear import (  # noqa: E402
    SuperlinearCoreAttention,
    SuperlinearKVCache,
)

VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def _world():
    subq.init_single_process()
    yield
    subq.destroy_single_process()


def _model(seed=0, max_sequence_length=128, **overrides):
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  use_cpu_initialization=True, subq_impl="kernel",
                  **variant_test_settings("superlinear"))  # attention_variant="superlinear"
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return subq.build_gpt_model(subq.SubqTransformerConfig(**kwargs), vocab_size=VOCAB,
                                max_sequence_length=max_sequence_length)


def _cores(model):
    return [m for m in model.modules() if isinstance(m, SuperlinearCoreAttention)]


def _set_graph(model, on: bool):
    """The cores read the switch from their config at every step (one config object)."""
    for core in _cores(model):
        core.config.superlinear_decode_graph = on


def _decode(model, tokens, prompt):
    """Logits [b, T - prompt + 1, V]: after the prompt's prefill, then of each step fed the
    given tokens; and the session (its caches)."""
    session = DecodeSession(model, tokens.shape[0], tokens.shape[1] + 1)
    out = [session.prefill(tokens[:, :prompt])]
    out += [session.step(tokens[:, t]) for t in range(prompt, tokens.shape[1])]
    return torch.stack(out, dim=1), session


def test_plan_path_equals_the_eager_step_across_buckets():
    """Steps at lengths 14..18 cross the bucket boundary 16 (capacities 16, then 32): the plan's
    logits equal the eager kernel's bitwise at every step, and greedy generation across the
    boundary gives the same tokens. (Each step is ~1 s in the interpreter: few steps.)"""
    model = _model()
    cores = _cores(model)
    assert cores and all(c.config is model.config for c in cores)
    tokens = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(1))
    eager, _ = _decode(model, tokens, prompt=13)
    assert all(c.decode_plan_steps == 0 for c in cores)  # off by default: the eager step
    _set_graph(model, True)
    try:
        assert all(c.decode_step_mode(torch.zeros(1, 1, 2, 16)) == "plan" for c in cores)
        planned, session = _decode(model, tokens, prompt=13)
        assert all(c.decode_plan_steps == 18 - 13 for c in cores)
        assert all(c.decode_graph_captures == 0 for c in cores)  # the CPU: no CUDA graph
        caches = session.context.key_value_memory_dict
        assert all(isinstance(c, SuperlinearKVCache) for c in caches.values())
        assert [c.decode_step.capacity for c in caches.values()] == [32, 32]  # length 18
        assert torch.equal(planned, eager)
        # greedy generation: prompts of 14 and 15 tokens, 3 new ones (lengths 15..18)
        prompts = [tokens[0, :14].tolist(), tokens[1, :15].tolist()]
        with_plan = generate(model, prompts, 3)
        _set_graph(model, False)
        assert with_plan == generate(model, prompts, 3)
    finally:
        _set_graph(model, False)


def test_plan_is_rebuilt_per_bucket_and_per_session():
    model = _model(seed=3)
    _set_graph(model, True)
    try:
        tokens = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
        session = DecodeSession(model, 1, 24)
        session.prefill(tokens[:, :15])
        cache = session.context.key_value_memory_dict[1]
        assert cache.decode_step is None  # the prefill does not use it
        session.step(tokens[:, 15])  # length 16: bucket 16
        first = cache.decode_step
        assert first.capacity == 16 and first.graph is None
        session.step(tokens[:, 16])  # length 17: bucket 32, a new plan
        second = cache.decode_step
        assert second is not first and second.capacity == 32
        session.step(tokens[:, 17])
        assert cache.decode_step is second  # the same bucket: the same plan
        assert second.k is cache.k and second.v is cache.v  # the cache tensors, not copies
        session.reset()
        session.prefill(tokens[:, :15])
        assert session.context.key_value_memory_dict[1] is not cache  # a new session's cache
    finally:
        _set_graph(model, False)


def test_reference_impl_stays_eager_on_the_cpu():
    """subq_impl None on the CPU resolves to the reference: the switch has no kernel to plan,
    so the step stays eager (it is no error: the same config runs the plan on a GPU)."""
    model = _model(subq_impl=None, superlinear_decode_graph=True)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    _decode(model, tokens, prompt=9)
    assert all(c.decode_plan_steps == 0 for c in _cores(model))


@pytest.mark.parametrize("value,match", [
    ("yes", "superlinear_decode_graph='yes' is invalid: allowed True or False"),
    (1, "superlinear_decode_graph=1 is invalid: allowed True or False"),
])
def test_bad_switch_values_name_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        subq.SubqTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   attention_variant="superlinear",
                                   superlinear_decode_graph=value)


def test_switch_refuses_the_reference_implementation():
    with pytest.raises(ValueError, match="superlinear_decode_graph=True is invalid with "
                                         "subq_impl='reference'"):
        subq.SubqTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   attention_variant="superlinear", subq_impl="reference",
                                   superlinear_decode_graph=True)


def test_trainer_flag():
    from megatron_subq.training import arguments
    from megatron_subq.training.checkpointing import NON_MODEL_KNOBS

    parser = arguments.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--superlinear-decode-graph", "--no-superlinear-decode-graph"} <= flags
    assert "superlinear_decode_graph" in NON_MODEL_KNOBS  # a checkpoint loads either way
    assert subq.SubqTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4
                                      ).superlinear_decode_graph is False


# ------------------------------------------------------------------------------------------------
# GPU: the captured step in generation
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_generation_with_and_without_the_graph():
    """bf16, GQA 8/2 x 128 (the kernels' GPU head size), the paper's knobs but a small window
    (sw_index 3: w = 15) so that anchors and spans are used: prompts of 500 and 509 tokens,
    40 new tokens (lengths 501..549 cross the 512 bucket). The captured steps give the eager
    kernel's logits bitwise and the same greedy tokens; each layer captures once per bucket
    (2 buckets: 512 and 1024) and replays every step."""
    model = _model(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                   kv_channels=128, subq_impl=None, superlinear_sw_index=3,
                   superlinear_forward_factor=0.0, bf16=True, params_dtype=torch.bfloat16,
                   max_sequence_length=1024).cuda()
    cores = _cores(model)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 560), generator=g).cuda()
    eager, _ = _decode(model, tokens[:, :550], prompt=500)
    assert all(c.decode_plan_steps == 0 for c in cores)
    _set_graph(model, True)
    try:
        assert all(c.decode_step_mode(tokens[:1, None, None].to(torch.bfloat16)) == "graph"
                   for c in cores)
        captured, session = _decode(model, tokens[:, :550], prompt=500)
        torch.cuda.synchronize()
        assert all(c.decode_graph_captures == 2 for c in cores), \
            [c.decode_graph_captures for c in cores]  # buckets 512 and 1024
        assert all(c.decode_plan_steps == 50 for c in cores)
        steps = [c.decode_step for c in session.context.key_value_memory_dict.values()]
        assert all(s.capacity == 1024 and s.graph is not None and s.replays == 550 - 512
                   for s in steps), [(s.capacity, s.replays) for s in steps]
        assert torch.equal(captured, eager), float((captured - eager).abs().max())
        prompts = [tokens[0, :500].tolist(), tokens[1, :509].tolist()]
        with_graph = generate(model, prompts, 40)
        _set_graph(model, False)
        assert with_graph == generate(model, prompts, 40)
    finally:
        _set_graph(model, False)


def test_generate_tool_passes_the_switch(monkeypatch):
    """tools/generate.py --decode-cuda-graph rebuilds the checkpoint's model with
    ``superlinear_decode_graph=True`` (and without the flag, leaves it as saved)."""
    import megatron_subq.inference as inference
    from tools import generate as tool

    seen = []

    class Stop(Exception):
        pass

    def fake_load(load, step, tp, **overrides):
        seen.append(overrides)
        raise Stop

    monkeypatch.setattr(inference, "load_for_inference", fake_load)
    for extra in (["--decode-cuda-graph"], []):
        with pytest.raises(Stop):
            tool.main(["--load", "ckpt", "--prompt", "1 2", "--max-new-tokens", "2", *extra])
    assert seen == [dict(sequence_parallel=False, superlinear_decode_graph=True),
                    dict(sequence_parallel=False)]
