"""launch.launch's fast path: a repeated launch goes to the compiled kernel's own launcher when its
arguments specialise as an earlier launch's. The key must separate every launch Triton would compile
differently (alignment, == 1, divisibility by 16, int width, constexpr values, options); the GPU tests
run each variation after a cached launch and check the values, so a key that is too coarse fails."""

import pytest
import torch
import triton
import triton.language as tl

from triforge import _runtime, launch


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, stride, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o * stride, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, (a * x + y) * SCALE, mask=m)


def _run(x, y, a, n, stride, scale, block=128, **opts):
    out = torch.full((n,), float("nan"), dtype=torch.float32, device=y.device)
    launch.launch("test_axpy", _axpy_kernel, (triton.cdiv(n, block),), x, y, out, a, n, stride,
                  SCALE=scale, BLOCK=block, **opts)
    return out


def _ref(x, y, a, n, stride, scale):
    return ((a * x[: n * stride: stride].double() + y[:n].double()) * scale).float()


def test_grid_past_cuda_limits_is_refused_by_name():
    """A grid with more than 65535 programs on axis 1 or 2 raises a ValueError naming the kernel and the grid, before
    anything is launched (CUDA would answer "invalid argument"); a grid within the limits launches as before."""
    x = torch.randn(4, device="cuda" if not _runtime.INTERPRET else "cpu")
    for grid in ((1, 65536), (1, 1, 70000), (2, 65535 * 2, 1)):
        with pytest.raises(ValueError, match=r"test_axpy: launch grid .* more than 65535"):
            launch.launch("test_axpy", _axpy_kernel, grid, x, x, x, 1.0, 4, 1, SCALE=1.0, BLOCK=128)
    out = torch.full((4,), float("nan"), device=x.device)
    launch.launch("test_axpy", _axpy_kernel, (1, 1, 1), x, x, out, 2.0, 4, 1, SCALE=1.0, BLOCK=128)
    assert torch.allclose(out, 3 * x)
    assert launch.MAX_GRID_YZ == 65535


def test_eager_backward_not_under_create_graph():
    """launch.eager_backward: launch.eager's answer, except in grad mode (a backward run with create_graph=True)."""
    t = torch.zeros(4)
    with torch.no_grad():  # (the engine runs a plain backward with grad mode off)
        assert launch.eager_backward(t, None) and launch.eager(t)
    with torch.enable_grad():
        assert not launch.eager_backward(t) and launch.eager(t)


def test_arg_key_classes():
    """The key of a non-constexpr argument follows Triton's specialisation classes (CPU tensors suffice)."""
    k = launch._arg_key
    assert k(1) != k(2) and k(16) != k(17) and k(32) == k(48) and k(17) == k(33)
    assert k(2**31) != k(2**31 - 16) and k(2**31 - 16) == k(16)  # i64 vs i32
    assert k(True) != k(1) and k(1.0) != k(1) and k(None) != k(0)
    t = torch.zeros(64, dtype=torch.float32)
    assert k(t) == k(t[4:]) and k(t) != k(t[1:])  # 16-byte vs 4-byte alignment
    assert k(t) != k(t.to(torch.float16))
    assert k(object()) is launch._NO_KEY and k((1, 2)) is launch._NO_KEY


class _Param:
    def __init__(self, name, is_constexpr, default=None):
        self.name, self.is_constexpr, self.default = name, is_constexpr, default


class _FakeJit:
    """Stands in for a JITFunction (the interpreter's functions have no ``params``): the key needs only those."""
    params = [_Param("x_ptr", False), _Param("n", False), _Param("a", False), _Param("MODE", True),
              _Param("BLOCK", True, 128)]


def test_specialization_key_separates_what_triton_separates():
    f, key = _FakeJit(), launch.specialization_key
    t = torch.zeros(64)
    base = key(f, (4,), (t, 1000, 0.5, 2), {"BLOCK": 64, "num_warps": 4})
    assert base is not None and hash(base) is not None
    assert key(f, (8, 1), (torch.zeros(64), 1000 + 16, -2.0, 2), {"BLOCK": 64, "num_warps": 4}) == base
    for args, kw in [((t[1:], 1000, 0.5, 2), {"BLOCK": 64, "num_warps": 4}),  # alignment
                     ((t.half(), 1000, 0.5, 2), {"BLOCK": 64, "num_warps": 4}),  # dtype
                     ((t, 1, 0.5, 2), {"BLOCK": 64, "num_warps": 4}),  # == 1
                     ((t, 1024, 0.5, 2), {"BLOCK": 64, "num_warps": 4}),  # % 16
                     ((t, 2**40 + 8, 0.5, 2), {"BLOCK": 64, "num_warps": 4}),  # i64
                     ((t, 1000, 1, 2), {"BLOCK": 64, "num_warps": 4}),  # int where a float was
                     ((t, 1000, 0.5, 3), {"BLOCK": 64, "num_warps": 4}),  # positional constexpr value
                     ((t, 1000, 0.5, 2), {"BLOCK": 128, "num_warps": 4}),  # keyword constexpr value
                     ((t, 1000, 0.5, 2), {"BLOCK": 64, "num_warps": 8})]:  # launch option
        assert key(f, (4,), args, kw) != base, (args, kw)
    assert key(f, lambda meta: (4,), (t, 1000, 0.5, 2), {}) is None  # a grid of META
    assert key(f, (4,), (t, 1000, (1, 2), 2), {}) is None  # an argument the key cannot class
    assert key(object(), (4,), (t,), {}) is None  # no params: an autotuner or heuristics wrapper


def test_gluon_descriptor_keys():
    """A Gluon TMA descriptor keys by dtype, block shape and layout (what Triton 3.6 types it by), not by its
    tensor's shape, strides or address; launch.nvmma_layout is Gluon's default layout (CPU tensors suffice)."""
    gluon_hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    k, lay = launch._arg_key, launch.nvmma_layout
    assert lay([64, 128], torch.bfloat16) == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    assert lay([64, 64], torch.float16) == gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    assert lay([64, 32], torch.bfloat16) != lay([64, 128], torch.bfloat16)

    def desc(rows, cols, block, dtype=torch.bfloat16):
        return gluon_hopper.TensorDescriptor.from_tensor(torch.zeros(rows, cols, dtype=dtype), block,
                                                         lay(block, dtype))

    base = k(desc(256, 128, [64, 64]))
    assert base is not launch._NO_KEY and hash(base) is not None
    assert k(desc(1000, 64, [64, 64])) == base  # shape and strides: runtime arguments
    assert k(desc(256, 128, [32, 64])) != base  # block shape
    assert k(desc(256, 128, [64, 64], torch.float16)) != base  # dtype
    d = desc(256, 128, [64, 64])
    d.layout = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    assert k(d) != base  # layout


@pytest.mark.gpu
def test_gluon_launch_takes_the_fast_path_and_agrees():
    """A Gluon kernel with a TMA descriptor argument: the second launch (another tensor, another shape, same
    specialisation) goes through the fast path and copies its own tensor; a new block shape or dtype compiles anew."""
    if _runtime.arch() != "sm90":
        pytest.skip("the Gluon TMA kernels target sm90")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tests._gluon_copy import tma_copy_kernel

    def run(x, bm):
        out = torch.full(x.shape, float("nan"), dtype=torch.float32, device="cuda")
        d = TensorDescriptor.from_tensor(x, [bm, 64], launch.nvmma_layout([bm, 64], x.dtype))
        launch.launch("test_tma_copy", tma_copy_kernel, (triton.cdiv(x.shape[0], bm),), d, out, x.shape[0],
                      x.shape[1], 2.0, BM=bm, BN=64, num_warps=4)
        return out

    launch._fast.clear()
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(run(x, 64), 2.0 * x.float())
    assert len(launch._fast) == 1
    x2 = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(run(x2, 64), 2.0 * x2.float())  # the fast path: no new entry
    assert len(launch._fast) == 1
    x3 = torch.randn(77, 64, device="cuda", dtype=torch.float16)
    assert torch.equal(run(x3, 64), 2.0 * x3.float())  # dtype: its own kernel
    assert torch.equal(run(x2, 32), 2.0 * x2.float())  # block shape: its own kernel
    assert len(launch._fast) == 3


@pytest.mark.gpu
def test_fast_path_is_taken_and_agrees():
    x = torch.randn(1000, device="cuda")
    y = torch.randn(1000, device="cuda")
    launch._fast.clear()
    first = _run(x, y, 0.5, 1000, 1, 2.0)
    assert len(launch._fast) == 1
    x2, y2 = torch.randn_like(x), torch.randn_like(y)
    second = _run(x2, y2, -1.5, 999, 1, 2.0)  # same specialisation (n not 1, not a multiple of 16): cached
    assert len(launch._fast) == 1
    torch.testing.assert_close(first, _ref(x, y, 0.5, 1000, 1, 2.0))
    torch.testing.assert_close(second, _ref(x2, y2, -1.5, 999, 1, 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["misaligned", "n_is_1", "stride_2", "constexpr", "block", "warps"])
def test_each_specialisation_gets_its_own_kernel(variant):
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    launch._fast.clear()
    torch.testing.assert_close(_run(x, y, 0.5, 1024, 1, 2.0), _ref(x, y, 0.5, 1024, 1, 2.0))
    args = dict(x=x, y=y, a=0.25, n=1024, stride=1, scale=2.0)
    opts = {}
    if variant == "misaligned":  # Triton assumed 16-byte alignment of x for the first kernel
        args["x"] = x[1:]
    elif variant == "n_is_1":
        args["n"] = 1
    elif variant == "stride_2":  # stride 1 is a compile-time constant in the first kernel
        args["stride"] = 2
    elif variant == "constexpr":
        args["scale"] = -3.0
    elif variant == "block":
        opts["block"] = 256
    elif variant == "warps":
        opts["num_warps"] = 8
    got = _run(args["x"], args["y"], args["a"], args["n"], args["stride"], args["scale"], **opts)
    torch.testing.assert_close(got, _ref(args["x"], args["y"], args["a"], args["n"], args["stride"], args["scale"]))
    assert len(launch._fast) == 2
    again = _run(args["x"], args["y"], args["a"], args["n"], args["stride"], args["scale"], **opts)
    assert torch.equal(again, got)


@pytest.mark.gpu
def test_fast_path_under_cuda_graph_capture():
    x, y = torch.randn(512, device="cuda"), torch.randn(512, device="cuda")
    _run(x, y, 1.0, 512, 1, 1.0)  # cached
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _run(x, y, 1.0, 512, 1, 1.0)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, _ref(x, y, 1.0, 512, 1, 1.0))


@pytest.mark.gpu
def test_a_registered_launch_hook_takes_the_jit_path():
    from triton import knobs

    x, y = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
    _run(x, y, 1.0, 256, 1, 1.0)  # cached
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        torch.testing.assert_close(_run(x, y, 1.0, 256, 1, 1.0), _ref(x, y, 1.0, 256, 1, 1.0))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1


def test_interpreter_never_caches():
    if not _runtime.INTERPRET:
        pytest.skip("the interpreter's path")
    launch._fast.clear()
    x = torch.randn(300)
    y = torch.randn(300)
    torch.testing.assert_close(_run(x, y, 0.5, 300, 1, 2.0), _ref(x, y, 0.5, 300, 1, 2.0))
    assert not launch._fast


def test_bench_rotation_exceeds_the_l2():
    """bench.rotation_count: enough input sets that together they hold four L2s (so a set's data is evicted before
    it comes round again), at least 1, at most MAX_SETS; set_bytes counts tensors and objects that report their
    resident bytes (a TernaryTensor's codes are not a tensor value of the inputs)."""
    from triforge import bench
    from triforge.ternary import TernaryTensor

    l2 = 50 * 2**20
    for nbytes in (1, 3 << 20, 12 << 20, 25 << 20, 60 << 20, 1 << 30):
        n = bench.rotation_count(nbytes, l2)
        assert 1 <= n <= bench.MAX_SETS
        assert n == bench.MAX_SETS or n * nbytes >= 4 * l2
        assert n == 1 or (n - 1) * nbytes < 4 * l2  # no more than needed
    assert bench.rotation_count(3 << 20, l2) == bench.MAX_SETS  # 200 MB / 3 MB = 66.7 sets: capped
    assert bench.rotation_count(12 << 20, l2) == 17
    tt = TernaryTensor.from_float(torch.randn(48, 200), method="absmean")
    x = torch.randn(3, 200)
    assert bench.set_bytes({"x": x, "tt": tt, "eps": 1e-6}) == 3 * 200 * 4 + tt.nbytes("resident")
    assert tt.nbytes("resident") >= 2 * 48 * 7 * 4  # its two int32 planes at least


@pytest.mark.gpu
def test_graph_time_ms_replays_the_captured_calls():
    """bench.graph_time_ms: every call warmed outside the capture, then captured once; each replay runs
    the captured calls (the output moves by the calls' count per replay), and the statistics are ordered."""
    from triforge.bench import graph_time_ms

    acc = torch.zeros(1, device="cuda")
    seen = []

    def fn():
        seen.append(1)
        acc.add_(1.0)

    stats = graph_time_ms(fn, calls=3, replays=5)
    # 3 warm-up calls, 3 on the capture stream, 3 captured (run by each of the 1 + 5 replays)
    assert len(seen) == 9
    assert float(acc.item()) == 6 + 3 * 6
    assert 0 < stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"] and stats["n"] == 5


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    """The launchers' plain-Python cdiv / next_power_of_2 (Triton 3.6's are constexpr functions costing microseconds
    per host call) give Triton's values, int64-sized arguments included."""
    import triton

    from triforge import launch

    for a in list(range(0, 300)) + [2**31 - 1, 2**31, 2**40 + 7, 65536 * 10240]:
        for b in (1, 2, 3, 7, 16, 32, 64, 128, 1000):
            assert launch.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for n in list(range(0, 5000)) + [2**31 - 1, 2**31, 2**31 + 1, 2**40 - 3]:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
