"""Superlinear inference: chunked prefill against a cached prefix and the O(sqrt(L)) decode step.

* Chunked prefill (ragged chunks, one of a single token) followed by token-by-token decode equals
  one full forward, for the reference (fp64, exact to rounding) and the kernels (fp32 under
  ``TRITON_INTERPRET=1`` on the CPU), with GQA and caches longer than what is filled (the rest is
  NaN: it must never be read).
* The decode kernel reads only the rows of its definition: every other cache row poisoned with NaN
  (keys outside candidates, spans and window; values outside spans and window) leaves the output
  unchanged. With ``superlinear_decode_cost`` this is the O(sqrt(L)) claim.
* Half dtypes: kernel vs the fp32 reference from the same rounded inputs, relative RMS
  ``‖x − ref‖₂ / ‖ref‖₂`` ≤ 3e-3 (fp16) and 2e-2 (bf16), the bounds of the training kernels
  (tests/test_superlinear_kernel.py); seen ≤ 3e-4 (fp16) and ≤ 3e-3 (bf16) in the interpreter.
* Bad arguments give ValueErrors that name the argument.

The ``gpu``-marked tests run the Nemotron layout (32 query heads, 2 KV heads, d = 128, bf16) at
64K-1M tokens of context: decode against the reference decode and, with a window that covers the
whole cache, against dense attention over the full cache; chunked prefill at 16K.
"""

import math

import pytest
import torch

pytest.importorskip("triton")  # tests/conftest.py sets TRITON_INTERPRET=1 first on the CPU

from megatron_subq import ops  # noqa: E402
from megatron_subq.kernels.superlinear import (  # noqa: E402
    SuperlinearDecodePlan,
    superlinear_decode_kernel,
)
from megatron_subq.testing.kernels import BOUNDS, DEVICE, rel_rms  # noqa: E402
from megatron_subq.ops.superlinear import (  # noqa: E402
    anchor_offsets,
    ceil_power,
    ceil_times,
    superlinear_attention_reference,
    superlinear_topk_reference,
    superlinear_window,
)

ISSUE_KNOBS = dict(search_power=0.5, span_power=0.5, topk=2, backward_factor=4.0,
                   forward_factor=2.0, sw_index=32)  # issue 7's benchmark configuration


def _inputs(B, T, H, H_kv, D, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q, q_s = (torch.randn(B, T, H, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, T, H_kv, D, generator=g) for _ in range(2))
    return [x.to(device=device, dtype=dtype) for x in (q, q_s, k, v)]


def _cache(x, capacity):
    """x [B, T, H_kv, D] in a NaN-filled cache of ``capacity`` positions."""
    cache = torch.full((x.shape[0], capacity) + tuple(x.shape[2:]), float("nan"), dtype=x.dtype,
                       device=x.device)
    cache[:, :x.shape[1]] = x
    return cache


def _prefill_then_decode(q, q_s, k, v, bounds, knobs, impl):
    """Rows [0, T) from prefill chunks [bounds[j], bounds[j+1]) then one decode step per token,
    each call seeing only its prefix in a larger NaN-padded cache."""
    T = q.shape[1]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        k_cache, v_cache = _cache(k[:, :b], T + 3), _cache(v[:, :b], T + 3)
        outs.append(ops.superlinear_prefill(q[:, a:b], q_s[:, a:b], k_cache, v_cache, start=a,
                                            **knobs, impl=impl))
    for i in range(bounds[-1], T):
        k_cache, v_cache = _cache(k[:, :i + 1], T + 3), _cache(v[:, :i + 1], T + 3)
        outs.append(ops.superlinear_decode_step(q[:, i], q_s[:, i], k_cache, v_cache,
                                                length=i + 1, **knobs, impl=impl)[:, None])
    return torch.cat(outs, dim=1)


KNOBS = [
    dict(sw_index=1, forward_factor=0.5),  # w = 3, forward spans
    dict(topk=3, search_power=1 / 3, span_power=2 / 3, backward_factor=3.0, sw_index=2),  # w = 26
    dict(),  # no window: the anchor t = i is always a candidate
]
KNOB_IDS = ["w3-f", "p1/3-w26", "w0"]


# ------------------------------------------------------------------------------------------
# prefill + decode == one full forward
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs", KNOBS, ids=KNOB_IDS)
def test_reference_prefill_and_decode_equal_full_forward(knobs):
    q, q_s, k, v = _inputs(2, 61, 4, 2, 8, dtype=torch.float64, device="cpu")
    full = superlinear_attention_reference(q, q_s, k, v, **knobs)
    got = _prefill_then_decode(q, q_s, k, v, [0, 1, 9, 30, 47], knobs, "reference")
    assert got.dtype == q.dtype and got.shape == full.shape
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)


TORCH_GLUE = '"fused_merge": false, "fused_mix": false, "gate_kernel": false'


@pytest.mark.parametrize("launch", ["{}", '{"fused_mix": false}', '{%s}' % TORCH_GLUE,
                                    '{%s, "elementwise_mix": false}' % TORCH_GLUE])
@pytest.mark.parametrize("knobs", KNOBS[:2], ids=KNOB_IDS[:2])
def test_kernel_prefill_and_decode_equal_full_forward(knobs, launch, monkeypatch):
    # the defaults (merge in the span kernel, mixture in mix_fwd_kernel, the search's scores for
    # the gate), the torch mixture, the torch glue (element-wise, and einsum)
    monkeypatch.setenv("MEGATRON_SUBQ_SUPERLINEAR_LAUNCH", launch)
    q, q_s, k, v = _inputs(2, 41, 4, 2, 8)
    full = superlinear_attention_reference(q, q_s, k, v, **knobs)
    got = _prefill_then_decode(q, q_s, k, v, [0, 13, 14, 38], knobs, "kernel")
    assert got.dtype == q.dtype and got.shape == full.shape
    assert rel_rms(got, full) <= BOUNDS[torch.float32]


def test_prefill_default_start_and_single_token_chunks():
    """start defaults to L - C; a one-token prefill chunk is a decode step."""
    knobs = dict(sw_index=1)
    q, q_s, k, v = _inputs(1, 23, 2, 1, 8)
    full = superlinear_attention_reference(q, q_s, k, v, **knobs)
    for impl in ("reference", "kernel"):
        tail = ops.superlinear_prefill(q[:, 15:], q_s[:, 15:], k, v, **knobs, impl=impl)
        assert rel_rms(tail, full[:, 15:]) <= 1e-5
        one = ops.superlinear_prefill(q[:, 7:8], q_s[:, 7:8], k, v, start=7, **knobs, impl=impl)
        step = ops.superlinear_decode_step(q[:, 7], q_s[:, 7], k, v, length=8, **knobs, impl=impl)
        torch.testing.assert_close(one[:, 0], step, rtol=1e-6, atol=1e-6)
        assert rel_rms(step, full[:, 7]) <= 1e-5


@pytest.mark.parametrize("chunk,block_n,mma", [(8, 8, False), (64, 16, False), (32, 16, True)],
                         ids=["chunk8", "chunk64", "chunk32-mma"])
def test_decode_kernel_split_k_layouts(chunk, block_n, mma):
    """Spans and window split over several parts (chunk 8) or one part each (chunk 64); a query
    with fewer candidates than top-k; position 0. ``mma``: the dots as 16-row tensor-core tiles
    (search: the group's heads; attend: q and the probabilities' hi/lo rows)."""
    knobs = dict(topk=3, sw_index=2, backward_factor=2.0, forward_factor=1.0)  # w = 8
    q, q_s, k, v = _inputs(1, 90, 4, 2, 8, seed=2)
    full = superlinear_attention_reference(q, q_s, k, v, **knobs)
    for length in (90, 11, 1):
        got = superlinear_decode_kernel(q[:, length - 1], q_s[:, length - 1], k, v, length,
                                        **knobs, chunk=chunk, block_n=block_n, mma=mma)
        assert rel_rms(got, full[:, length - 1]) <= BOUNDS[torch.float32], length


def test_decode_without_anchors_is_window_attention():
    """w = 48 > i: no candidate at all, the output is attention over the window (everything)."""
    q, q_s, k, v = _inputs(1, 30, 2, 2, 8)
    got = ops.superlinear_decode_step(q[:, -1], q_s[:, -1], k, v, sw_index=6, impl="kernel")
    dense = torch.softmax(torch.einsum("bhd,bthd->bht", q[:, -1], k) / math.sqrt(8), dim=-1)
    assert rel_rms(got, torch.einsum("bht,bthd->bhd", dense, v)) <= 1e-5


def test_decode_ties_go_to_the_nearest_anchor():
    """q_s = 0: every search score ties; the kernel keeps the nearest candidates, as the
    reference (a different choice would attend to other spans)."""
    knobs = dict(sw_index=1, topk=2)
    q, q_s, k, v = _inputs(1, 70, 2, 1, 8)
    q_s = torch.zeros_like(q_s)
    ref = superlinear_attention_reference(q, q_s, k, v, **knobs)[:, -1]
    got = ops.superlinear_decode_step(q[:, -1], q_s[:, -1], k, v, **knobs, impl="kernel")
    assert rel_rms(got, ref) <= 1e-5


# ------------------------------------------------------------------------------------------
# the decode step reads O(sqrt(L)) rows: exactly those of the definition
# ------------------------------------------------------------------------------------------
def _rows_read(q_s, k, knobs):
    """Rows of (k, v) [T, H_kv] the last query of the definition needs: keys at every candidate
    anchor (search), keys and values of the kept spans and of the window."""
    B, T, H, _ = q_s.shape
    H_kv, group, i = k.shape[2], q_s.shape[2] // k.shape[2], T - 1
    p, sw = knobs.get("search_power", 0.5), knobs.get("sw_index", 0)
    w = superlinear_window(p, sw)
    scale = ceil_power(i, knobs.get("span_power", 0.5))
    back = ceil_times(knobs.get("backward_factor", 2.0), scale)
    fwd = ceil_times(knobs.get("forward_factor", 0.0), scale)
    key_rows = torch.zeros(T, H_kv, dtype=torch.bool)
    value_rows = torch.zeros(T, H_kv, dtype=torch.bool)
    key_rows[[i - d for d in anchor_offsets(T, p, sw) if d <= i]] = True
    if w > 0:
        value_rows[max(0, i - w + 1):] = True
    kept = superlinear_topk_reference(q_s, k, p, sw, knobs.get("topk", 2))[0, i]  # [H, k]
    for h in range(H):
        for t in kept[h].tolist():
            if t >= 0:
                value_rows[max(0, t - back):min(i, t + fwd) + 1, h // group] = True
    return key_rows | value_rows, value_rows


def test_decode_kernel_reads_only_its_rows():
    knobs = dict(sw_index=1, topk=2)  # w = 3, b = 2, f = 0
    q, q_s, k, v = _inputs(1, 300, 4, 2, 8, seed=4)
    expected = superlinear_attention_reference(q, q_s, k, v, **knobs)[:, -1]
    key_rows, value_rows = _rows_read(q_s.cpu(), k.cpu(), knobs)
    assert (~key_rows).float().mean() > 0.4  # most of the cache is poisoned: a real check
    k_bad = k.masked_fill(~key_rows.to(k.device)[None, :, :, None], float("nan"))
    v_bad = v.masked_fill(~value_rows.to(v.device)[None, :, :, None], float("nan"))
    got = ops.superlinear_decode_step(q[:, -1], q_s[:, -1], k_bad, v_bad, **knobs, impl="kernel")
    assert torch.isfinite(got).all()
    assert rel_rms(got, expected) <= BOUNDS[torch.float32]


def test_decode_cost_grows_as_sqrt_length():
    knobs = ISSUE_KNOBS
    costs = {L: ops.superlinear_decode_cost(L, **knobs) for L in (1 << 16, 1 << 20, 1 << 24)}
    for L, c in costs.items():
        root = math.isqrt(L - 1) + 1
        assert c["search"] <= root and c["window"] == 1088
        assert c["spans"] <= 2 * ((4 + 2) * root + 1)  # top-2 spans of ceil(b*l)+ceil(f*l)+1
        assert c["total"] == c["search"] + c["spans"] + c["window"]
    # x256 the context, ~x16 the span and search work (the window is a constant)
    growth = ((costs[1 << 24]["total"] - 1088) / (costs[1 << 16]["total"] - 1088))
    assert 15 < growth < 17
    # what the decode geometry says equals what the reference reads at small L
    c = ops.superlinear_decode_cost(300, sw_index=1, topk=2)
    assert c["search"] == len(ops.superlinear_anchors(299, 0.5, 1))
    assert c["spans"] == 2 * (2 * 18 + 1) and c["window"] == 3


# ------------------------------------------------------------------------------------------
# half dtypes
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_dtypes(dtype):
    knobs = dict(sw_index=1, forward_factor=0.5)
    q, q_s, k, v = _inputs(1, 41, 4, 2, 16, dtype=dtype, seed=5)
    full = superlinear_attention_reference(*(x.float() for x in (q, q_s, k, v)), **knobs)
    chunk = ops.superlinear_prefill(q[:, 24:40], q_s[:, 24:40], k[:, :40], v[:, :40], start=24,
                                    **knobs, impl="kernel")
    step = ops.superlinear_decode_step(q[:, 40], q_s[:, 40], k, v, **knobs, impl="kernel")
    assert chunk.dtype == dtype and step.dtype == dtype
    assert rel_rms(chunk, full[:, 24:40]) <= BOUNDS[dtype]
    assert rel_rms(step, full[:, 40]) <= BOUNDS[dtype]
    for mma in (False, True):  # both dot forms of the decode kernels, tiles of 16 keys
        step = superlinear_decode_kernel(q[:, 40], q_s[:, 40], k, v, 41, **knobs, chunk=32,
                                         block_n=16, mma=mma)
        assert step.dtype == dtype and rel_rms(step, full[:, 40]) <= BOUNDS[dtype], mma


def test_decode_tile_defaults(monkeypatch):
    """On a GPU the tensor-core form is the default up to head dim 128 (what its GPU tests and
    timings cover) with tiles of >= 16 keys; the interpreter keeps the CUDA-core form."""
    from megatron_subq.kernels.superlinear import decode

    assert decode.decode_tiles(16, 128) == (16, 4, False)  # the interpreter (CPU tests)
    monkeypatch.setattr(decode, "triton_interpreting", lambda: False)
    assert decode.decode_chunk_default() == 256
    assert decode.decode_tiles(256, 128) == (64, 4, True)
    assert decode.decode_tiles(256, 256) == (64, 4, False)
    assert decode.decode_tiles(256, 256, mma=True) == (64, 4, True)
    assert decode.decode_tiles(8, 128) == (8, 4, False)
    assert decode.decode_tiles(256, 64, block_n=32, warps=8, mma=False) == (32, 8, False)


def test_decode_launch_options_are_checked():
    q, q_s, k, v = _inputs(1, 10, 4, 2, 8, device="cpu")
    cases = [(dict(block_n=8, mma=True), "mma=True needs block_n >= 16"),
             (dict(block_n=12), "block_n=12 is invalid"), (dict(warps=3), "warps=3 is invalid")]
    for launch, message in cases:
        with pytest.raises(ValueError, match=message):
            superlinear_decode_kernel(q[:, 9], q_s[:, 9], k, v, 10, chunk=16, **launch)
        with pytest.raises(ValueError, match=message):
            SuperlinearDecodePlan(1, 4, 2, 8, capacity=16, dtype=q.dtype, device="cpu", chunk=16,
                                  **launch)


# ------------------------------------------------------------------------------------------
# bad arguments
# ------------------------------------------------------------------------------------------
def test_bad_arguments():
    q, q_s, k, v = _inputs(1, 10, 4, 2, 8, device="cpu")
    prefill, decode = ops.superlinear_prefill, ops.superlinear_decode_step
    cases = [
        (lambda: prefill(q[0], q_s, k, v), "q must have shape"),
        (lambda: prefill(q, q_s[:, :5], k, v), "q_s must have the shape of q"),
        (lambda: prefill(q, q_s, k, v[:, :9]), "k_cache and v_cache must have one shape"),
        (lambda: prefill(q, q_s, k[..., :4], v[..., :4]), "head dim"),
        (lambda: prefill(q, q_s, torch.cat([k, k]), torch.cat([v, v])), "batch"),
        (lambda: prefill(q[:, :, :3], q_s[:, :, :3], k, v), "multiple"),
        (lambda: prefill(q, q_s, k[:, :9], v[:, :9]), "k_cache holds 9 positions"),
        (lambda: prefill(q[:, :4], q_s[:, :4], k, v, start=7), "start=7"),
        (lambda: prefill(q[:, :4], q_s[:, :4], k, v, start=-1), "start=-1"),
        (lambda: prefill(q[:, :4], q_s[:, :4], k, v, start=1.0), "start=1.0"),
        (lambda: prefill(q, q_s, k.double(), v.double()), "share a dtype"),
        (lambda: prefill(q, q_s, k, v, topk=0), "topk=0"),
        (lambda: prefill(q, q_s, k, v, impl="fast"), "impl='fast'"),
        (lambda: prefill(q, q_s, k[0], v[0]), "k_cache must have shape"),
        (lambda: decode(q, q_s[:, 0], k, v), "q must be a tensor of shape"),
        (lambda: decode(q[:, 0], q_s, k, v), "q_s must be a tensor of shape"),
        (lambda: decode(q[:, 0], q_s[:, 0], k, v, length=0), "length=0"),
        (lambda: decode(q[:, 0], q_s[:, 0], k, v, length=11), "length=11"),
        (lambda: decode(q[:, 0], q_s[:, 0], k, v, sw_index=-1), "sw_index=-1"),
        (lambda: decode(q[:, 0], q_s[:, 0], k, v, search_power=0), "search_power=0"),
        (lambda: decode(q[:, 0, :3], q_s[:, 0, :3], k, v), "multiple"),
        (lambda: ops.superlinear_decode_cost(0), "length=0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            call()
    with pytest.raises(TypeError, match="q_s must be a torch.Tensor"):
        prefill(q, None, k, v)


# ------------------------------------------------------------------------------------------
# the capturable form: one plan per capacity bucket, integers in a device buffer
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs,chunk,launch", [
    (dict(sw_index=2, topk=3, forward_factor=1.0), 8, dict(block_n=8)),
    (dict(sw_index=1), 16, dict(block_n=8)),
    (dict(sw_index=2, topk=3, forward_factor=1.0), 16, dict(block_n=16, mma=True))],
    ids=["chunk8", "chunk16", "chunk16-mma"])
def test_decode_plan_equals_eager_at_every_length_of_its_bucket(knobs, chunk, launch):
    """The fixed launches of a plan (bucket-sized grids, extra parts empty) give the eager
    kernel's output bitwise at every length of the bucket, from one plan reused across lengths
    (what a replayed graph does), and the full forward's row."""
    q, q_s, k, v = _inputs(1, 64, 4, 2, 8, seed=5)
    full = superlinear_attention_reference(q, q_s, k, v, **knobs)
    plan = SuperlinearDecodePlan(1, 4, 2, 8, capacity=64, dtype=q.dtype, device=q.device,
                                 **knobs, chunk=chunk, **launch)
    for length in (33, 34, 47, 63, 64):
        plan.set_length(length)
        got = plan.run(q[:, length - 1], q_s[:, length - 1], k, v).clone()
        eager = superlinear_decode_kernel(q[:, length - 1], q_s[:, length - 1], k, v, length,
                                          **knobs, chunk=chunk, **launch)
        assert torch.equal(got, eager), length
        assert rel_rms(got, full[:, length - 1]) <= BOUNDS[torch.float32], length
    small = SuperlinearDecodePlan(1, 4, 2, 8, capacity=1, dtype=q.dtype, device=q.device)
    small.set_length(1)  # position 0: the window (or, without one, nothing but itself)
    assert rel_rms(small.run(q[:, 0], q_s[:, 0], k, v), full[:, 0]) <= 1e-5


def test_decode_plan_refuses_lengths_outside_its_bucket():
    plan = SuperlinearDecodePlan(1, 2, 1, 8, capacity=32, dtype=torch.float32, device=DEVICE)
    for bad in (16, 33, 0, 20.0, True):
        with pytest.raises(ValueError, match=r"length=.* allowed an integer in \[17, 32\]"):
            plan.set_length(bad)
    with pytest.raises(RuntimeError, match="call set_length first"):
        x = torch.zeros(1, 2, 8)
        plan.run(x, x, torch.zeros(1, 32, 1, 8), torch.zeros(1, 32, 1, 8))
    with pytest.raises(ValueError, match="capacity=24 is invalid"):
        SuperlinearDecodePlan(1, 2, 1, 8, capacity=24, dtype=torch.float32, device=DEVICE)


# ------------------------------------------------------------------------------------------
# GPU scale (skipped without CUDA)
# ------------------------------------------------------------------------------------------
def _nemotron_decode_inputs(L, dtype=torch.bfloat16, seed=7):
    """One decode query (32 query heads, 2 KV heads, d = 128) over a cache of L tokens."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, q_s = (torch.randn(1, 32, 128, generator=g, device=DEVICE).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, L, 2, 128, generator=g, device=DEVICE).to(dtype) for _ in range(2))
    return q, q_s, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1 << 16, 1 << 20], ids=["64k", "1M"])
def test_decode_gpu_matches_reference(L):
    q, q_s, k, v = _nemotron_decode_inputs(L)
    got = ops.superlinear_decode_step(q, q_s, k, v, **ISSUE_KNOBS, impl="kernel")
    ref = ops.superlinear_decode_step(*(x.float() for x in (q, q_s, k, v)), **ISSUE_KNOBS,
                                      impl="reference")
    assert rel_rms(got, ref) <= BOUNDS[torch.bfloat16]
    for launch in (dict(mma=False), dict(mma=True), dict(block_n=32, mma=True),
                   dict(block_n=128, warps=8, mma=True)):  # every dot form and tile tried
        got = superlinear_decode_kernel(q, q_s, k, v, L, **ISSUE_KNOBS, chunk=256, **launch)
        assert rel_rms(got, ref) <= BOUNDS[torch.bfloat16], launch


@pytest.mark.gpu
@pytest.mark.parametrize("L,sw_index", [(1 << 16, 256), (1 << 20, 1024)], ids=["64k", "1M"])
def test_decode_gpu_full_window_equals_dense_attention(L, sw_index):
    """A window of (sw_index + 1)^2 - 1 >= L tokens covers the whole cache: the decode step is
    dense attention over it (split over ~L / 512 parts), against fp32 and SDPA."""
    q, q_s, k, v = _nemotron_decode_inputs(L)
    got = ops.superlinear_decode_step(q, q_s, k, v, sw_index=sw_index, impl="kernel")
    kf, vf = (x[0].float().transpose(0, 1) for x in (k, v))  # [2, L, 128]
    q_grouped = q[0].float().view(2, 16, 128)  # query head h reads key head h // 16
    probs = torch.softmax(torch.einsum("kgd,kld->kgl", q_grouped, kf) / math.sqrt(128), dim=-1)
    dense = torch.einsum("kgl,kld->kgd", probs, vf).reshape(1, 32, 128)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)[:, :, 0]
    assert rel_rms(got, dense) <= BOUNDS[torch.bfloat16]
    assert rel_rms(got, sdpa) <= BOUNDS[torch.bfloat16]


@pytest.mark.gpu
def test_prefill_gpu_chunks_nemotron_layout():
    """16K tokens in ragged chunks (GQA 32/2, d = 128, bf16) against the fp32 reference."""
    T = 16384
    q, q_s, k, v = _inputs(1, T, 32, 2, 128, dtype=torch.bfloat16, seed=8)
    q_s = q_s * 128 ** -0.5
    bounds = [0, 4096, 4097, 9000, T]
    got = torch.cat([ops.superlinear_prefill(q[:, a:b], q_s[:, a:b], k, v, start=a,
                                             **ISSUE_KNOBS, impl="kernel")
                     for a, b in zip(bounds, bounds[1:])], dim=1)
    ref = superlinear_attention_reference(*(x.float() for x in (q, q_s, k, v)), **ISSUE_KNOBS)
    assert rel_rms(got, ref) <= BOUNDS[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [False, True], ids=["fma", "mma"])
def test_decode_plan_gpu_graph_replays_every_length(mma):
    """One CUDA graph of a plan's step at 1M capacity (Nemotron layout, bf16, the paper's
    kernel knobs), replayed after set_length at several lengths of the bucket: the eager
    kernel's output at each (the same kernels on the same parts: equal)."""
    from megatron_subq.cuda_graphs import capture_cuda_graph

    L = 1 << 20
    q, q_s, k, v = _nemotron_decode_inputs(L)
    plan = SuperlinearDecodePlan(1, 32, 2, 128, capacity=L, dtype=q.dtype, device=q.device,
                                 **ISSUE_KNOBS, mma=mma)
    plan.set_length(L)
    graph, out = capture_cuda_graph(lambda: plan.run(q, q_s, k, v))
    for length in (L // 2 + 1, 700_001, L):
        plan.set_length(length)
        graph.replay()
        eager = superlinear_decode_kernel(q, q_s, k, v, length, **ISSUE_KNOBS, mma=mma)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), length
