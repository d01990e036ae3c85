"""ops.standard_prefill, the dense arm's decode and chunked prefill: equal to its reference, and
handing SDPA the forms its fused kernels take, on the cache's own buffers. A decode step is
``[B, H, 1, D]`` queries with SDPA's GQA and no mask (flash decoding); a later chunk is a
``CausalBias`` aligned bottom-right; K and V are never repeated or copied. (The form a GQA
decode step used to take, a KV head's query heads as query rows of one head, ran 13.5-52 ms per
layer at 1M tokens in the model against 0.41 ms for flash decoding: docs/inference.md.) cuDNN's
backend is off for the call: it plans per key length, and a cache's length changes every step."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias

from megatron_subq.ops import standard as standard_ops
from megatron_subq.ops.standard import standard_prefill
from megatron_subq.training.arguments import SDPA_BACKENDS, apply_sdpa_backend

CASES = [(2, 4, 2, 16, 16), (1, 4, 4, 16, 16), (2, 4, 2, 16, 8)]  # B, H, H_kv, D, Dv


@pytest.mark.parametrize("B,H,H_kv,D,Dv", CASES, ids=["gqa", "mha", "narrow-v"])
@pytest.mark.parametrize("start,C", [(0, 1), (9, 1), (0, 7), (5, 3)],
                         ids=["first", "decode", "prefill", "later-chunk"])
def test_sdpa_forms_and_results(monkeypatch, B, H, H_kv, D, Dv, start, C):
    g = torch.Generator().manual_seed(start * 10 + C)
    L = start + C + 2  # cache rows past start + C are never read
    q = torch.randn(B, C, H, D, generator=g)
    k_cache = torch.randn(B, L, H_kv, D, generator=g)
    v_cache = torch.randn(B, L, H_kv, Dv, generator=g)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape, key, value, attn_mask, kwargs))
        # cuDNN would build a plan per new cache length (~40 ms each on an H200); flash stays on
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    # the module's F only: CausalBias calls torch's own SDPA inside
    monkeypatch.setattr(standard_ops, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    monkeypatch.setattr(standard_ops, "repeat_kv", lambda *a: pytest.fail("K/V repeated"))
    got = standard_prefill(q, k_cache, v_cache, start=start)
    monkeypatch.undo()
    ref = standard_prefill(q, k_cache, v_cache, start=start, impl="reference")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got.shape == (B, C, H, Dv)
    [(q_shape, key, value, mask, kwargs)] = calls
    assert q_shape == (B, H, C, D)
    assert kwargs["enable_gqa"] is (H != H_kv)
    # the cache's buffers themselves, seen as [B, H_kv, start + C, D]: no copy
    assert key.data_ptr() == k_cache.data_ptr() and value.data_ptr() == v_cache.data_ptr()
    assert key.shape == (B, H_kv, start + C, D)
    if C == 1:
        assert mask is None and kwargs["is_causal"] is False
    elif start == 0:
        assert mask is None and kwargs["is_causal"] is True
    else:
        assert isinstance(mask, CausalBias) and kwargs["is_causal"] is False


@pytest.mark.parametrize("only", SDPA_BACKENDS[1:])
def test_backend_choice_keeps_the_users_but_cudnn(monkeypatch, only):
    """--subq-sdpa-backend NAME (torch's enable_*_sdp) still holds inside standard_prefill:
    cuDNN is dropped only from what is enabled, and kept when it is the one backend enabled."""
    seen = []
    sdpa = F.scaled_dot_product_attention
    cuda = torch.backends.cuda

    def flags():
        return {name: getattr(cuda, f"{name}_sdp_enabled")() for name in SDPA_BACKENDS[1:]}

    def spy(*args, **kwargs):
        seen.append(flags())
        with sdpa_kernel(SDPBackend.MATH):  # the CPU has no efficient or cuDNN kernel
            return sdpa(*args, **kwargs)

    monkeypatch.setattr(standard_ops, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    before = flags()
    try:
        apply_sdpa_backend(only)  # what the trainer does with the flag
        q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 5, 2, 8)
        standard_prefill(q, k, k.clone())
        after = flags()
    finally:
        for name, on in before.items():
            getattr(cuda, f"enable_{name}_sdp")(on)
    assert seen == [{name: name == only for name in before}]
    assert after == {name: name == only for name in before}  # restored after the call
