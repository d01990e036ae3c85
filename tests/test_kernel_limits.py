"""The kernels' 32-bit offsets: sizes they cannot address are refused with a clear error before
anything is allocated or launched (``kernels.common.check_int32_offsets``). Shapes live on the
``meta`` device, so multi-billion-element inputs cost nothing here."""

import pytest
import torch

pytest.importorskip("triton")

from megatron_subq.testing.kernels import kernel_package  # noqa: E402


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


# [B, T, H, D] with T * H * D = 2^31 + a chunk: one past what int32 offsets reach
HUGE = (1, 2**31 // (32 * 128) + 64, 32, 128)


@pytest.mark.parametrize("op", ["nonapprox", "approx"])
def test_deconstructed_kernels_refuse_unaddressable_inputs(op):
    fn = getattr(kernel_package(op), f"{op}_attention_kernel")
    B, T, H, D = HUGE
    with pytest.raises(ValueError, match=r"q has .* elements, more than the kernels' 32-bit"):
        fn(_meta(B, T, H, D), _meta(B, T, 2, D), _meta(B, T, 2, D))


def test_approx_refuses_unaddressable_chunk_states():
    # inputs fit (512K tokens x 16 heads x 128), the D x D state per 64-token chunk does not
    fn = kernel_package("approx").approx_attention_kernel
    q = _meta(1, 2**19, 16, 128)
    with pytest.raises(ValueError, match="chunk_states"):
        fn(q, q, q)


def test_superlinear_refuses_unaddressable_pair_outputs():
    # 1M tokens, Nemotron's 32 query / 2 KV heads: q itself is 2^32 elements
    fn = kernel_package("superlinear").superlinear_attention_kernel
    q = _meta(1, 2**20, 32, 128)
    kv = _meta(1, 2**20, 2, 128)
    with pytest.raises(ValueError, match=r"superlinear_attention_kernel: q has"):
        fn(q, q, kv, kv)


def test_sizes_below_the_limit_pass_the_check():
    from megatron_subq.kernels.common import INT32_MAX, check_int32_offsets

    check_int32_offsets("op", q=INT32_MAX)
    with pytest.raises(ValueError, match="op: x has 2,147,483,648 elements"):
        check_int32_offsets("op", x=INT32_MAX + 1)


def test_asa_refuses_unaddressable_inputs():
    fn = kernel_package("asa").asa_attention_kernel
    B, T, H, D = HUGE
    p = _meta(H, D, 64)
    with pytest.raises(ValueError, match=r"asa_attention_kernel: q has"):
        fn(_meta(B, T, H, D), _meta(B, T, 2, D), _meta(B, T, 2, D), p, p)
