"""Launch configs and compiled-kernel records.

Tuned configs live in ``triforge/configs/<arch>.json`` (written by ``triforge tune --write``)::

    {"kernels": {"rms_norm_fwd": {"block_n=4096,dtype=bf16": {"num_warps": 8, ...}}}}

Launchers call :func:`config` with a key and a heuristic fallback; nothing is autotuned at run time.
Each launch is recorded so the bench can report registers, spills and shared memory.
"""

import contextlib
import functools
import json
import os
from pathlib import Path

import torch

from triforge import _runtime

CONFIG_DIR = Path(__file__).parent / "configs"

# kernel name -> the CompiledKernel of its latest compiled launch
_compiled: dict = {}


def cdiv(a, b):
    """ceil(a / b) for integers: ``triton.cdiv``'s value without its cost. Triton 3.6 wraps cdiv and
    next_power_of_2 as constexpr functions, ~2 us per host call here and ~10 on the GPU machine's host;
    the launchers call them on every op call (the mHC K1 backward nine times: ~90 us of its host path)."""
    return (a + b - 1) // b


def next_power_of_2(n):
    """The smallest power of 2 >= n (0 for n <= 0, as ``triton.next_power_of_2``), without its cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_DTYPE_TAGS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_tag(dtype: torch.dtype) -> str:
    """Short dtype name used in config keys: fp32, fp16, bf16."""
    return _DTYPE_TAGS[dtype]


def config_key(**fields) -> str:
    return ",".join(f"{k}={fields[k]}" for k in sorted(fields))


def configs_file(arch: str, device: str | None = None) -> Path:
    """The configs file of an arch (``<arch>.json``), or of one device model of it (``<arch>.<device>.json``, a
    :func:`triforge._runtime.device_tag`): a device's entries are read over the arch's, key by key, so a GPU
    that differs from the one the arch's entries were tuned on (an H200 against the H100) keeps its own."""
    return CONFIG_DIR / (f"{arch}.json" if device is None else f"{arch}.{device}.json")


def _read_kernels(path: Path) -> dict:
    return json.loads(path.read_text()).get("kernels", {}) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def _table(arch: str, device: str | None = None) -> dict:
    """kernel -> key -> entry: the arch's file, with the device's file (if any) over it, each entry's fields
    merged (a device entry may set only what its tuning space holds; the arch's other fields, e.g. the
    attention forward's GLUON, stay)."""
    merged = {kernel: {key: dict(entry) for key, entry in keys.items()}
              for kernel, keys in _read_kernels(configs_file(arch)).items()}
    if device is not None:
        for kernel, keys in _read_kernels(configs_file(arch, device)).items():
            for key, entry in keys.items():
                merged.setdefault(kernel, {}).setdefault(key, {}).update(entry)
    return merged


_reload_hooks: list = []


def reload() -> None:
    """Re-read the configs files (after ``triforge tune --write``); clears every :func:`config_cache`."""
    _table.cache_clear()
    for clear in _reload_hooks:
        clear()


def config_cache(fn):
    """``functools.lru_cache`` for a launcher's plan derived from :func:`config` (hashable arguments):
    the plan is worked out once per shape instead of on every call, and :func:`reload` clears it."""
    cached = functools.lru_cache(maxsize=1024)(fn)
    _reload_hooks.append(cached.cache_clear)
    return cached


def _tuned_on(data: dict, entry: str) -> str:
    """The device a configs file's provenance names for an entry ('?' where it records none)."""
    prov = data.get("provenance", {}).get(entry)
    return str(prov.get("device", "?")) if isinstance(prov, dict) else "?"


def config_sources(arch: str, device: str | None = None) -> list[tuple[str, str, dict, str, str]]:
    """Every stored entry an (arch, device) reads, as (kernel, key, merged entry, where from, tuned on): the arch's
    file name, the device's, or both joined by ' + ' (the device's fields over the arch's), and the device each of
    those files' provenance names, joined the same way ('?' where one records none)."""
    files = [configs_file(arch)] + ([configs_file(arch, device)] if device is not None else [])
    data = [json.loads(f.read_text()) if f.exists() else {} for f in files]
    rows = []
    kernels = sorted({k for d in data for k in d.get("kernels", {})})
    for kernel in kernels:
        for key in sorted({key for d in data for key in d.get("kernels", {}).get(kernel, {})}):
            holders = [(f, d) for f, d in zip(files, data) if key in d.get("kernels", {}).get(kernel, {})]
            rows.append((kernel, key, _table(arch, device)[kernel][key], " + ".join(f.name for f, _ in holders),
                         " + ".join(_tuned_on(d, f"{kernel}[{key}]") for _, d in holders)))
    return rows


def stored_config(kernel: str, key: str) -> dict | None:
    """The entry stored for ``kernel`` at ``key`` for this device: its arch's configs file with the device's
    own file over it (:func:`configs_file`; None: the launcher falls back)."""
    found = _table(*_runtime.config_scope()).get(kernel, {}).get(key)
    return None if found is None else dict(found)


def config(kernel: str, key: str, fallback: dict) -> dict:
    """The tuned launch config for ``kernel`` at ``key`` on this arch, else ``fallback``."""
    found = stored_config(kernel, key)
    if found is None:
        return dict(fallback)
    merged = dict(fallback)
    merged.update(found)
    return merged


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # Parameter disables __torch_function__: a plain tensor


def eager(*tensors) -> bool:
    """Whether a custom op may be bypassed: plain tensors and no tracer (dynamo, the dispatch
    modes AOTAutograd and make_fx trace under, torch.jit.trace). Then an op's eager path calls its launcher directly
    under a plain autograd.Function: torch.library's dispatch and autograd wrappers cost more host
    time per call than the launch itself (RoPE's backward on the H100 machine: 310 us per call through
    the custom op's autograd against 186 through an autograd.Function; benchmarks/host_overhead_probe.py),
    which starves the GPU at shapes whose kernels take a few hundred microseconds."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or torch.jit.is_tracing():
        return False
    return all(type(t) in _PLAIN for t in tensors if t is not None)


def eager_backward(*tensors) -> bool:
    """:func:`eager` for a backward that would call its backward op's body directly: also not under
    ``create_graph`` (grad mode on inside a backward), where the direct call's results would carry no graph and a
    double backward would silently drop the op's second-order term; the op then runs, and a double backward through
    it differentiates it or raises as the op's registration says."""
    return not torch.is_grad_enabled() and eager(*tensors)


def eager_function(name: str, impl, setup_context, backward):
    """An autograd.Function running ``impl`` (the custom op's own body) with the op's
    ``setup_context`` and ``backward``: the eager twin of a torch.library op with registered autograd."""

    def forward(ctx, *inputs):
        out = impl(*inputs)
        setup_context(ctx, inputs, out)
        return out

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward),
    })


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third dimensions


def launch(kernel_name: str, jit_fn, grid, *args, nbytes: int | None = None, **kwargs):
    """Launch a Triton kernel and remember its compiled form (registers, spills, shared memory).

    ``nbytes`` is the launch's byte model; while torch.profiler records, the launch is annotated
    ``triforge::<jit function name> bytes=<nbytes>`` for ``triforge trace``.

    A launch whose arguments specialise as an earlier launch's did (:func:`specialization_key`) goes
    straight to that compiled kernel's own launcher, skipping the JIT's argument binding and cache
    lookup: on the H100 machine's host 23.8 us per launch instead of 39.7 (ternary GEMV, 22 arguments,
    of which the compiled launcher itself 11 us; benchmarks/ternary_host_probe.py). Anything the key
    cannot describe takes the JIT's path; TRIFORGE_FAST_LAUNCH=0 sends every launch there.

    A grid past CUDA's 65535 programs on its second or third axis raises ValueError (in the interpreter too, which
    has no such limit): CUDA would refuse the launch with a bare "invalid argument".
    """
    if not callable(grid) and len(grid) > 1 and max(grid[1:]) > MAX_GRID_YZ:
        raise ValueError(
            f"{kernel_name}: launch grid {tuple(grid)} has more than {MAX_GRID_YZ} programs on its second or third "
            f"axis (CUDA's limit there; these axes count batch or sequences x heads): split the call into smaller "
            f"batches")
    if nbytes is not None and torch.autograd.profiler._is_profiler_enabled:
        name = getattr(jit_fn, "__name__", kernel_name)
        with torch.profiler.record_function(f"triforge::{name} bytes={int(nbytes)}"):
            compiled = jit_fn[grid](*args, **kwargs)
    elif _runtime.INTERPRET or not _FAST_ON:
        compiled = jit_fn[grid](*args, **kwargs)
    else:
        key = specialization_key(jit_fn, grid, args, kwargs)
        try:
            entry = _fast.get(key) if key is not None else None
        except TypeError:  # a keyword or constexpr value that does not hash
            key = entry = None
        if entry is not None and not _hooks_active():
            compiled, tail = entry
            g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            stream = torch._C._cuda_getCurrentRawStream(key[1])  # key[1]: the current device
            compiled.run(*g, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
            _compiled[kernel_name] = compiled
            return compiled
        compiled = jit_fn[grid](*args, **kwargs)
        if key is not None and compiled is not None:
            _remember(key, jit_fn, compiled, len(args), kwargs)
    if compiled is not None and not _runtime.INTERPRET:
        _compiled[kernel_name] = compiled
    return compiled


# ------------------------------------------------------------------ the fast path of ``launch``

_FAST_ON = os.environ.get("TRIFORGE_FAST_LAUNCH", "1") != "0"  # 0: every launch through the JIT (for A/B checks)
_fast: dict = {}  # specialization key -> (CompiledKernel, values of the parameters after the positional ones)
_FAST_MAX = 4096
_params: dict = {}  # id(jit function) -> (parameter names, constexpr flags, defaults, the function itself)


def _signature(jit_fn):
    # by id: a JITFunction hashes its source-derived cache key; the entry holds the function, so its id
    # (also part of every launch key) cannot be reused by another function while the entry lives
    sig = _params.get(id(jit_fn))
    if sig is None:
        ps = jit_fn.params
        sig = _params[id(jit_fn)] = (
            tuple(p.name for p in ps), tuple(bool(p.is_constexpr) for p in ps),
            tuple(p.default for p in ps), jit_fn,
        )
    return sig


def _arg_key(a):
    """How Triton 3.6 specialises a non-constexpr argument: tensors by dtype and 16-byte alignment of
    the data pointer, ints by == 1 (made a constant), divisibility by 16 and i32 / i64 / u64 range,
    bools and floats by type only, Gluon TMA descriptors by dtype, block shape and layout. _NO_KEY for anything
    else (the launch then takes the JIT's path).
    (The same classes as the loop in :func:`specialization_key`, which inlines them for speed.)"""
    t = type(a)
    if t is int:
        if -2147483648 <= a <= 2147483647:
            return 1 if a == 1 else 0 if a & 15 else 16
        return ("L", a & 15 == 0, a > 0x7FFFFFFFFFFFFFFF)
    if isinstance(a, _Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if t is bool:
        return "b"
    if t is float:
        return "f"
    if a is None:
        return None
    if t is _GluonDesc:
        # Triton 3.6 types a Gluon descriptor by "tensordesc<dtype[block shape], layout>" and specialises it on
        # nothing else (its shape and strides are runtime arguments; its base is 16-byte aligned by construction)
        return ("desc", a.base.dtype, tuple(a.block_shape), a.layout)
    return _NO_KEY


def nvmma_layout(block_shape, dtype):
    """The NVMMA shared layout of a ``block_shape`` tile of torch ``dtype`` that Gluon picks by default
    (``NVMMASharedLayout.get_default_for``), cached: the host paths of the Gluon kernels build it on every call,
    ~4.5 us a layout on a workstation's Python, ~5x that on the GPU machine's host."""
    return _nvmma_layout(tuple(block_shape), dtype)


@functools.lru_cache(maxsize=64)
def _nvmma_layout(block_shape, dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block_shape), {torch.float16: gl.float16,
                                                                     torch.bfloat16: gl.bfloat16,
                                                                     torch.float32: gl.float32}[dtype])


_Tensor = torch.Tensor
_NO_KEY = object()
try:  # the Gluon kernels' host-side TMA descriptor (Triton >= 3.5)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDesc
except ImportError:  # pragma: no cover - older Triton: no Gluon kernels either
    _GluonDesc = None
_device_index = getattr(torch._C, "_cuda_getDevice", lambda: -1)  # CPU builds of torch: no CUDA device


def specialization_key(jit_fn, grid, args, kwargs):
    """A hashable key equal for two launches exactly when Triton would run the same compiled kernel
    for both (finer is allowed, never coarser): the function, the device, each positional argument's
    specialisation class (its value where the parameter is constexpr) and the keywords by value.
    None when the launch cannot be keyed: a grid of META, an autotuner or heuristics wrapper, an
    argument of another type. Runs on every launch, so the classes of ``_arg_key`` are inlined (the
    GPU machine's host runs Python ~5x slower than a workstation; every microsecond shows)."""
    if callable(grid):
        return None
    sig = _params.get(id(jit_fn))
    if sig is None:
        if not hasattr(jit_fn, "params"):
            return None
        sig = _signature(jit_fn)
    const = sig[1]
    if len(args) > len(const):
        return None
    key = [id(jit_fn), _device_index()]  # _params keeps jit_fn alive: the id stays its own
    app = key.append
    for a, c in zip(args, const):
        if c:
            app(a)
        elif type(a) is int and -2147483648 <= a <= 2147483647:
            app(1 if a == 1 else 0 if a & 15 else 16)
        elif isinstance(a, _Tensor):
            app((a.dtype, a.data_ptr() & 15 == 0))
        else:
            k = _arg_key(a)
            if k is _NO_KEY:
                return None
            app(k)
    key.extend(kwargs.items())
    return tuple(key)


def _remember(key, jit_fn, compiled, n_positional, kwargs):
    names, const, defaults, _ = _signature(jit_fn)
    tail = []
    for name, c, d in zip(names[n_positional:], const[n_positional:], defaults[n_positional:]):
        if not c:
            return  # a runtime parameter given by keyword or left to its default: keep the JIT's path
        tail.append(kwargs[name] if name in kwargs else d)
    compiled._init_handles()
    if len(_fast) >= _FAST_MAX:
        _fast.clear()
    _fast[key] = (compiled, tuple(tail))


def _hooks_active() -> bool:
    """Whether a launch hook is registered (a profiler such as proton): such launches keep the JIT's
    path, which hands the hooks their metadata. Triton 3.6 keeps the hooks as (normally empty) chains."""
    global _knobs
    if _knobs is None:
        from triton import knobs

        _knobs = knobs
    rt = _knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


_knobs = None


@functools.lru_cache(maxsize=None)
def pdl_supported() -> bool:
    """Programmatic dependent launch: compiled kernels on sm90+ only."""
    return (not _runtime.INTERPRET) and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL_ENV = "TRIFORGE_PDL"


def pdl_wanted() -> bool:
    """The library-wide switch for programmatic dependent launch (``TRIFORGE_PDL``, default 1; 0 turns it off),
    read by the callers that launch that way by default (the decode-attention op, the Qwen2 engine)."""
    return os.environ.get(PDL_ENV, "1") != "0"


def maxnreg_option(cfg: dict) -> dict:
    """Launch kwargs for a config's register cap (key ``maxnreg``; compiled kernels only, the interpreter has no
    registers): fewer registers per thread, more programs resident per SM, at some spill risk."""
    return {"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") and not _runtime.INTERPRET else {}


def pdl_options(pdl: bool) -> dict:
    """Launch kwargs for a kernel with a ``PDL`` constexpr: ``PDL`` (the kernel waits with
    griddepcontrol.wait before reading what earlier kernels wrote) and ``launch_pdl`` (the launch may
    begin while the previous kernel in the stream drains). Off where unsupported."""
    on = bool(pdl) and pdl_supported()
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


_resident: dict = {}


def resident_programs(jit_fn, args, kwargs) -> int:
    """How many programs of this launch one SM holds at once (registers, threads, shared memory, the
    32-block limit), from the kernel compiled for these arguments (compiled here if it is not yet):
    what a grid-wide barrier needs to know to keep its grid resident. Cached per specialisation."""
    key = specialization_key(jit_fn, (1,), args, kwargs)
    found = _resident.get(key) if key is not None else None
    if found is not None:
        return found
    compiled = jit_fn.warmup(*args, grid=(1,), **kwargs)
    compiled._init_handles()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    nw = compiled.metadata.num_warps
    per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
    # four schedulers, each with a quarter of the register file and whole warps
    by_regs = 4 * (getattr(props, "regs_per_multiprocessor", 65536) // 4 // per_warp) // nw
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * nw)
    smem = compiled.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // (smem + 1024) if smem else 32
    n = max(0, min(32, by_regs, by_threads, by_smem))
    if key is not None:
        _resident[key] = n
    return n


def kernel_resources(kernel_name: str) -> dict | None:
    """Registers per thread, spilled registers and shared memory bytes of the last launch."""
    compiled = _compiled.get(kernel_name)
    if compiled is None:
        return None
    meta = compiled.metadata
    return {
        "registers": getattr(compiled, "n_regs", None),
        "spills": getattr(compiled, "n_spills", None),
        "shared_bytes": getattr(meta, "shared", None),
        "num_warps": getattr(meta, "num_warps", None),
        "num_stages": getattr(meta, "num_stages", None),
    }


def recorded_kernels() -> list[str]:
    return sorted(_compiled)


_POISON = {"on": False}


@contextlib.contextmanager
def poisoned(enabled: bool = True):
    """Within this block, launcher outputs are allocated filled with NaN (integers: -1)."""
    old = _POISON["on"]
    _POISON["on"] = enabled
    try:
        yield
    finally:
        _POISON["on"] = old


def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tensor_descriptors() -> None:
    """Call before launching a kernel that builds tensor descriptors on the device: they live in a
    per-launch global scratch buffer that Triton asks an allocator for. Unless the caller set one, the
    caching allocator provides it (the setting is per thread: autograd's backward runs in its own)."""
    if _runtime.INTERPRET:
        return
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_descriptor_scratch)


def new_output(shape, dtype, device) -> torch.Tensor:
    """Allocate a kernel output: uninitialised normally, NaN-filled under ``poisoned()``."""
    if _POISON["on"]:
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)
