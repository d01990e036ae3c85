"""kernels/launch.py: ``fast(kernel)[grid](**kwargs)`` relaunches a compiled kernel only under
a key at least as fine as Triton's specialisation, and passes what Triton's own ``run`` passes.

CPU: a stand-in kernel whose ``[grid]`` records the plain launches and returns a stand-in
compiled kernel whose ``run`` records the fast ones. GPU: the ASA op's outputs and gradients
are bitwise the same with the fast path on (second call: relaunches) and off."""

import types

import pytest
import torch

from megatron_subq.kernels import launch


class _Compiled:
    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """Stands in for a JITFunction: ``fn`` gives the signature, ``[grid]`` a plain launch."""

    def __init__(self):
        def fn(x_ptr, n, scale, flag, BLOCK=4, MODE="a"):
            pass
        self.fn = fn
        self.plain = []
        self.compiled = []

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            c = _Compiled()
            self.compiled.append(c)
            return c
        return go


@pytest.fixture
def fake_gpu(monkeypatch):
    """The fast path's GPU lookups answered on the CPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(launch.ENV, raising=False)
    monkeypatch.setattr(launch, "_cuda", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda device: 1234)
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(launch, "_knobs", lambda: hooks)
    return hooks


def _args(x, **over):
    kw = dict(x_ptr=x, n=64, scale=0.5, flag=True, BLOCK=8, num_warps=4)
    kw.update(over)
    return kw


def test_second_launch_of_a_key_relaunches_the_compiled_kernel(fake_gpu):
    k = _Kernel()
    x = torch.zeros(32, dtype=torch.float16)
    f = launch.FastLaunch(k)
    first = f[(3, 2)](**_args(x))
    assert len(k.plain) == 1 and first is k.compiled[0]
    again = f[(5,)](**_args(x, scale=0.25))  # floats are not part of the key
    assert again is first and len(k.plain) == 1
    # Triton's run: grid as three numbers, the stream, the handle, the packed metadata, the
    # launch metadata (None without hooks), the hooks, then every parameter in signature order
    # (defaults filled in, constexprs included), tensors as their data pointers
    assert first.runs == [(5, 1, 1, 1234, "fn-handle", "packed", None, None, None,
                           x.data_ptr(), 64, 0.25, True, 8, "a")]


@pytest.mark.parametrize("change", ["int", "dtype", "alignment", "bool-for-int", "constexpr",
                                    "num_warps", "device"])
def test_a_launch_that_triton_could_specialise_differently_is_not_relaunched(fake_gpu,
                                                                                  monkeypatch,
                                                                                  change):
    k = _Kernel()
    x = torch.zeros(32, dtype=torch.float16)
    f = launch.FastLaunch(k)
    f[(1,)](**_args(x))
    other = {
        "int": _args(x, n=65),
        "dtype": _args(x.float()),
        "alignment": _args(x[1:]),  # 2 bytes off a 16-byte boundary
        "bool-for-int": _args(x, flag=1),
        "constexpr": _args(x, BLOCK=16),
        "num_warps": _args(x, num_warps=8),
        "device": _args(x),
    }[change]
    if change == "device":
        monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 1)
    f[(1,)](**other)
    assert len(k.plain) == 2 and k.compiled[0].runs == []


def test_plain_path_cases(fake_gpu, monkeypatch):
    k = _Kernel()
    x = torch.zeros(32, dtype=torch.float16)
    f = launch.FastLaunch(k)
    f[(1,)](**_args(x))
    f[lambda meta: (1,)](**_args(x))          # a callable grid
    f[(1,)](x, 64, 0.5, True)                 # positional arguments
    monkeypatch.setenv(launch.ENV, "0")       # the A/B knob
    f[(1,)](**_args(x))
    monkeypatch.delenv(launch.ENV)
    f[(1,)](x_ptr=x, n=64, scale=0.5, flag=True, BLOCK=8, typo=1)  # Triton's own error
    f[(1,)](x_ptr=x, n=64, scale=0.5)  # a parameter missing: Triton's own error
    monkeypatch.setattr(launch, "_cuda", lambda: False)  # no GPU
    f[(1,)](**_args(x))
    assert len(k.plain) == 7 and k.compiled[0].runs == []


def test_hook_chains_without_hooks_are_not_called(fake_gpu):
    """Triton 3.6's hooks are ``HookChain`` objects, never None: an empty chain is passed as
    None (no launch metadata built, nothing called), a chain with hooks as itself."""
    empty, full = types.SimpleNamespace(calls=[]), types.SimpleNamespace(calls=["h"])
    k = _Kernel()
    x = torch.zeros(32, dtype=torch.float16)
    f = launch.FastLaunch(k)
    compiled = f[(1,)](**_args(x))
    compiled.launch_metadata = lambda grid, stream, *values: "meta"
    fake_gpu.launch_enter_hook, fake_gpu.launch_exit_hook = empty, empty
    f[(1,)](**_args(x))
    fake_gpu.launch_exit_hook = full
    f[(1,)](**_args(x))
    assert [r[6:9] for r in compiled.runs] == [(None, None, None), ("meta", None, full)]


def test_launch_hooks_get_their_metadata(fake_gpu):
    k = _Kernel()
    x = torch.zeros(32, dtype=torch.float16)
    f = launch.FastLaunch(k)
    compiled = f[(1,)](**_args(x))
    compiled.launch_metadata = lambda grid, stream, *values: ("meta", grid, stream, len(values))
    fake_gpu.launch_enter_hook, fake_gpu.launch_exit_hook = "enter", "exit"
    f[(2, 3)](**_args(x))
    assert compiled.runs[0][:9] == (2, 3, 1, 1234, "fn-handle", "packed",
                                    ("meta", (2, 3), 1234, 6), "enter", "exit")


def test_interpreter_results_are_not_remembered(fake_gpu):
    """The interpreter's launch returns no compiled kernel: nothing to relaunch."""
    k = _Kernel()
    k.__class__ = type("_Interp", (_Kernel,), {
        "__getitem__": lambda self, grid: (lambda **kw: self.plain.append(kw))})
    f = launch.FastLaunch(k)
    x = torch.zeros(32, dtype=torch.float16)
    f[(1,)](**_args(x))
    f[(1,)](**_args(x))
    assert len(k.plain) == 2 and f.compiled == {}


def test_fast_is_one_wrapper_per_kernel():
    k1, k2 = _Kernel(), _Kernel()
    assert launch.fast(k1) is launch.fast(k1) and launch.fast(k1) is not launch.fast(k2)
    assert [launch.cdiv(a, 64) for a in (0, 1, 64, 65, 16384)] == [0, 1, 1, 2, 256]
    import triton  # noqa: PLC0415
    assert all(launch.pow2(n) == triton.next_power_of_2(n) for n in range(1, 1100))


@pytest.mark.gpu
def test_asa_fast_launch_is_bitwise_the_plain_launch_gpu(monkeypatch):
    from megatron_subq.ops import asa_attention

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    B, T, H, H_kv, D, m = 2, 700, 4, 2, 128, 64
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, T, H, D, device=dev, dtype=dt)
    k = torch.randn(B, T, H_kv, D, device=dev, dtype=dt)
    v = torch.randn(B, T, H_kv, D, device=dev, dtype=dt)
    p_q = torch.randn(H, D, m, device=dev, dtype=dt) * D ** -0.5
    p_k = torch.randn(H, D, m, device=dev, dtype=dt) * D ** -0.5
    g = torch.randn(B, T, H, D, device=dev, dtype=dt)

    def run():
        xs = [t.clone().requires_grad_() for t in (q, k, v, p_q, p_k)]
        o = asa_attention(*xs, normalize="linear", impl="kernel")
        o.backward(g)
        return [o.detach()] + [x.grad for x in xs]

    monkeypatch.setenv(launch.ENV, "0")
    plain = run()
    monkeypatch.setenv(launch.ENV, "1")
    run()          # remembers the compiled kernels
    fast = run()   # relaunches them
    for a, b in zip(plain, fast):
        assert torch.equal(a, b)


def test_bound_launch_keys_on_the_tensors_only(fake_gpu, monkeypatch):
    """``bind``: the fixed arguments once, then launches that key on the tensors (dtype,
    pointer mod 16, device) and pass every parameter in signature order, pointers as ints."""
    k = _Kernel()
    f = launch.FastLaunch(k)
    b = f.bind((3, 2), n=64, scale=0.5, flag=True, BLOCK=8, num_warps=4)
    x, y = torch.zeros(32, dtype=torch.float16), torch.zeros(32, dtype=torch.float16)
    first = b(x_ptr=x)
    assert len(k.plain) == 1 and k.plain[0][2] == dict(
        n=64, scale=0.5, flag=True, BLOCK=8, num_warps=4, x_ptr=x)
    again = b(x_ptr=y)  # another tensor of the same dtype and alignment: relaunched
    assert again is first and len(k.plain) == 1
    assert first.runs == [(3, 2, 1, 1234, "fn-handle", "packed", None, None, None,
                           y.data_ptr(), 64, 0.5, True, 8, "a")]
    for other in (x.float(), x[1:]):  # dtype, alignment: Triton's path
        b(x_ptr=other)
    monkeypatch.setattr(launch.torch.cuda, "current_device", lambda: 1)
    b(x_ptr=x)
    assert len(k.plain) == 4 and len(first.runs) == 1


def test_bound_plain_path_cases(fake_gpu, monkeypatch):
    k = _Kernel()
    f = launch.FastLaunch(k)
    x = torch.zeros(32, dtype=torch.float16)
    b = f.bind((1,), n=64, scale=0.5, flag=True)
    b(x_ptr=x)
    b(x_ptr=None)                                   # not a tensor
    f.bind((1,), n=64, scale=0.5, flag=True, typo=1)(x_ptr=x)   # unknown: Triton's error
    f.bind((1,), n=64, flag=True)(x_ptr=x)          # missing: Triton's error
    monkeypatch.setenv(launch.ENV, "0")
    b(x_ptr=x)
    assert len(k.plain) == 5 and k.compiled[0].runs == []
    monkeypatch.delenv(launch.ENV)
    b(x_ptr=x)
    assert len(k.compiled[0].runs) == 1


def test_bound_launch_hooks_see_the_tensors(fake_gpu):
    k = _Kernel()
    f = launch.FastLaunch(k)
    x = torch.zeros(32, dtype=torch.float16)
    b = f.bind((2, 3), n=64, scale=0.5, flag=True)
    compiled = b(x_ptr=x)
    compiled.launch_metadata = lambda grid, stream, *values: ("meta", grid, values[0] is x)
    fake_gpu.launch_enter_hook = "enter"
    b(x_ptr=x)
    assert compiled.runs[0][6:9] == (("meta", (2, 3), True), "enter", None)
