"""megatron_subq/experts.py: ``SubqSequentialMLP`` skips the experts without tokens when autograd
is off and returns exactly megatron's ``SequentialMLP`` output; with autograd on it is megatron's
forward (every expert's parameters get a gradient, empty experts' zero); the local spec provider
puts it where megatron's local spec has ``SequentialMLP``; a hybrid model decodes the same
tokens with it."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import megatron_subq as subq  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from megatron_subq.experts import SubqSequentialMLP  # noqa: E402
from megatron_subq.slots import SubqLocalSpecProvider  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _world():
    subq.init_single_process()
    yield
    subq.destroy_single_process()


def _pair(num_experts=6):
    """megatron's SequentialMLP and ours with the same weights (the local spec's submodules)."""
    config = subq.SubqTransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=num_experts,
        moe_ffn_hidden_size=24, moe_router_topk=2, use_cpu_initialization=True,
        add_bias_linear=False)
    provider = SubqLocalSpecProvider()
    module, submodules = provider.grouped_mlp_modules(False, False)
    assert module is SubqSequentialMLP  # the local spec's experts are ours
    submodules.activation_func = provider.activation_func()
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    groups = get_default_pg_collection()  # what megatron's MoELayer hands its experts
    torch.manual_seed(0)
    ours = build_module(module, num_experts, config, submodules=submodules,
                        pg_collection=groups)
    theirs = build_module(SequentialMLP, num_experts, config, submodules=submodules,
                          pg_collection=groups)
    theirs.load_state_dict(ours.state_dict())
    assert list(ours.state_dict()) == list(theirs.state_dict())  # checkpoints do not change
    return ours, theirs


@pytest.mark.parametrize("counts", [[3, 0, 0, 2, 0, 1], [0, 0, 0, 0, 0, 0], [0, 0, 4, 0, 0, 0],
                                    [1, 1, 1, 1, 1, 1]], ids=["some", "none", "one", "all"])
def test_no_grad_output_equals_megatrons(counts):
    ours, theirs = _pair()
    tokens = torch.tensor(counts)
    hidden = torch.randn(sum(counts), 32)
    probs = torch.rand(sum(counts))
    with torch.no_grad():
        got, bias = ours(hidden, tokens, probs)
        want, want_bias = theirs(hidden, tokens, probs)
    assert bias is None and want_bias is None
    assert got.shape == want.shape == (sum(counts), 32)
    assert torch.equal(got, want)


def test_skips_only_without_autograd():
    """Calls per expert: only those with tokens under no_grad; every one with autograd on, where
    the empty experts' parameters still get (zero) gradients as megatron's do."""
    ours, theirs = _pair()
    calls = []
    for i, expert in enumerate(ours.local_experts):
        expert.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    counts = torch.tensor([2, 0, 1, 0, 0, 3])
    hidden = torch.randn(6, 32, requires_grad=True)
    probs = torch.rand(6)
    with torch.no_grad():
        ours(hidden, counts, probs)
    assert calls == [0, 2, 5]
    calls.clear()
    got, _ = ours(hidden, counts, probs)
    want, _ = theirs(hidden, counts, probs)
    assert calls == [0, 1, 2, 3, 4, 5] and torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    empty = ours.local_experts[1].linear_fc1.weight.grad
    assert torch.count_nonzero(empty) == 0
