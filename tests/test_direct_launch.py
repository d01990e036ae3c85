"""kernels/common.py's DirectLauncher: the first launch of a specialisation goes through Triton's
JIT, later ones straight to the compiled kernel it returned, with every parameter in order; any
change Triton specialises on (a dtype, a pointer's 16-byte alignment, an int's divisibility by 16
or equality to 1, a constexpr, a launch option) is a new specialisation. A stand-in kernel
records what each path receives (the real kernels' GPU tests run through the launcher too)."""

import pytest
import torch

pytest.importorskip("triton")

from megatron_subq.kernels.common import LAUNCHER_ENV, DirectLauncher  # noqa: E402


class FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *params: self.log.append(("direct", grid, params))


class FakeJIT:
    """kernel(x_ptr, n, BLOCK: constexpr, MODE: constexpr) as Triton's JITFunction looks to the
    launcher: ``arg_names``, ``kernel[grid](...)`` returning its compiled kernel, ``warmup``."""

    arg_names = ["x_ptr", "n", "BLOCK", "MODE"]

    def __init__(self):
        self.log, self.compiled = [], []

    def __getitem__(self, grid):
        def jit(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            self.compiled.append(FakeCompiled(self.log))
            return self.compiled[-1]
        return jit

    def warmup(self, *args, grid, **meta):
        return self.compiled[0]


@pytest.fixture
def compiled_mode(monkeypatch):
    """As on a GPU: not interpreting, device 0."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield
    DirectLauncher.verify = False


def test_second_launch_is_direct_with_every_parameter(compiled_mode):
    jit = FakeJIT()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    launch[(4, 2)](x, 32, BLOCK=16, MODE="a", num_warps=4)
    launch[(8,)](x, 48, BLOCK=16, MODE="a", num_warps=4)  # 48: still divisible by 16
    assert [e[0] for e in jit.log] == ["jit", "direct"]
    assert jit.log[1][1] == (8, 1, 1)  # the grid padded to three dimensions
    assert jit.log[1][2][1:] == (48, 16, "a")  # args, then constexprs in signature order
    assert jit.log[1][2][0] is x


@pytest.mark.parametrize("change", ["dtype", "alignment", "divisibility", "one", "constexpr",
                                    "num_warps", "int64"])
def test_a_new_specialisation_goes_through_the_jit(change, compiled_mode):
    jit = FakeJIT()
    launch = DirectLauncher(jit)
    x = torch.zeros(64, dtype=torch.float16)
    args, meta = [x, 32], dict(BLOCK=16, MODE="a", num_warps=4)
    launch[(1,)](*args, **meta)
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.bfloat16)
    elif change == "alignment":
        args[0] = x[1:]  # 2 bytes past a 16-byte boundary
    elif change == "divisibility":
        args[1] = 33
    elif change == "one":
        args[1] = 1
    elif change == "int64":
        args[1] = 2**32
    elif change == "constexpr":
        meta["MODE"] = "b"
    else:
        meta["num_warps"] = 8
    launch[(1,)](*args, **meta)
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_interpreter_and_opt_out_always_use_the_jit(compiled_mode, monkeypatch):
    jit = FakeJIT()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    monkeypatch.setenv(LAUNCHER_ENV, "0")
    for _ in range(2):
        launch[(1,)](x, 32, BLOCK=16, MODE="a")
    monkeypatch.delenv(LAUNCHER_ENV)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch[(1,)](x, 32, BLOCK=16, MODE="a")
    assert [e[0] for e in jit.log] == ["jit", "jit", "jit"]


def test_verify_catches_a_key_that_picked_another_specialisation(compiled_mode):
    jit = FakeJIT()
    launch = DirectLauncher(jit)
    x = torch.zeros(64)
    DirectLauncher.verify = True
    launch[(1,)](x, 32, BLOCK=16, MODE="a")
    launch[(1,)](x, 32, BLOCK=16, MODE="a")  # warmup agrees: fine
    jit.compiled.insert(0, FakeCompiled(jit.log))  # the JIT would now pick another kernel
    with pytest.raises(AssertionError, match="another specialisation"):
        launch[(1,)](x, 32, BLOCK=16, MODE="a")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["asa", "nonapprox"])
def test_direct_launches_take_the_jits_kernel_gpu(op, monkeypatch):
    """On the GPU, every direct launch of a fwd+bwd (two shapes, odd lengths, GQA, twice each)
    takes the compiled kernel Triton's JIT would pick, and the results repeat exactly."""
    from megatron_subq import ops  # noqa: PLC0415

    monkeypatch.setattr(DirectLauncher, "verify", True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, T, H, H_kv, D in ((2, 1000, 8, 2, 128), (1, 333, 4, 4, 64)):
        q = torch.randn(B, T, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(B, T, H_kv, D, device="cuda", generator=g, dtype=torch.bfloat16)
                for _ in range(2))
        extra = []
        if op == "asa":
            extra = [torch.randn(H, D, 32, device="cuda", generator=g, dtype=torch.bfloat16)
                     for _ in range(2)]
        inputs = [x.requires_grad_() for x in [q, k, v] + extra]
        fn = ops.asa_attention if op == "asa" else ops.nonapprox_attention
        results = []
        for _ in range(2):
            out = fn(*inputs, impl="kernel")
            results.append((out,) + torch.autograd.grad(out, inputs, torch.ones_like(out)))
        for first, second in zip(*results):
            assert torch.equal(first, second)
