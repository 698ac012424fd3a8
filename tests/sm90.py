"""Compile @triton.jit kernels for Hopper (sm90a) without a GPU and report what the assembler made of them.

``compile_for_sm90(cases)`` runs one subprocess with TRITON_INTERPRET=0 (the test process runs Triton's
interpreter, where nothing is compiled): each case is built by ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, its PTX assembled by the triton wheel's ``ptxas -v`` for sm_90a (registers,
spill bytes) and its cubin disassembled by the wheel's ``nvdisasm`` (SASS opcode counts). A case is a dict:

    kernel      "package.module:function"
    signature   {argument: "*fp32" | "*i32" | "fp32" | ...}; arguments not named are "i32"
    constexprs  {argument: value}
    divisible   arguments a launch specialises as multiples of 16 (pointers, strides, aligned sizes)
    options     {"num_warps": 4, "num_stages": 1, ...}

and comes back with ``regs``, ``spill_bytes``, ``shared``, ``sass`` (opcode -> count over the kernel) and
``loops``: for each backward branch, the opcode counts of the instructions it repeats (a loop's body,
nested loops included), largest first.
"""

import json
import os
import subprocess
import sys

import pytest

# ptxas -v's C7515 warning: every wgmma of the kernel waits for the one before it (no asynchronous tensor-core
# pipeline); the group is the reason ptxas gives. Also read by tests/ops/attention/test_flash_attn.py's compile script.
C7515 = r"wgmma.mma_async instructions are serialized due to (.*?) in the"

_SCRIPT = r'''
import collections, importlib, json, os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def opcodes(lines):
    return dict(collections.Counter(m.group(2) for m in map(INSTR.match, lines) if m))


rows = []
for case in json.loads(sys.argv[1]):
    mod, name = case["kernel"].split(":")
    fn = getattr(importlib.import_module(mod), name)
    names, consts = fn.arg_names, dict(case.get("constexprs", {}))
    for prm in fn.params:  # a constexpr left out takes its default (else it would compile as a run-time i32)
        if prm.is_constexpr and prm.name not in consts and prm.has_default:
            consts[prm.name] = prm.default
    sig = {n: "constexpr" if n in consts else case.get("signature", {}).get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.get("divisible", ())}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=case.get("options", {}))
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        open(ptx, "w").write(k.asm["ptx"])
        open(cubin, "wb").write(k.asm["cubin"])
        info = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    txt = info.stdout + info.stderr
    labels = {l.strip()[:-1]: i for i, l in enumerate(sass) if re.match(r"^\.L\w+:$", l.strip())}
    loops = []
    for i, line in enumerate(sass):
        m = re.search(r"BRA `\((\.L\w+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append(opcodes(sass[labels[m.group(1)]:i + 1]))
    loops.sort(key=lambda c: -sum(c.values()))
    rows.append({"regs": int(re.search(r"Used (\d+) registers", txt).group(1)),
                 "spill_bytes": int(re.search(r"(\d+) bytes spill stores", txt).group(1)),
                 "shared": k.metadata.shared, "sass": opcodes(sass), "loops": loops,
                 "serialized": " ".join(re.findall(C7515, txt))})
print("RESULT" + json.dumps(rows))
'''.replace("import triton\n", "import triton\nC7515 = " + repr(C7515) + "\n", 1)


def compile_for_sm90(cases: list, timeout: int = 600) -> list:
    """See the module docstring; skips the calling test when the triton wheel lacks its ptxas."""
    import triton

    from triforge import _runtime

    if _runtime.HAS_CUDA and not _runtime.INTERPRET:
        # on the GPU machine this route's ptxas for sm_90a exited 255 (H100, 2026-11-22); there
        # tests/test_gpu.py reads registers and spills from the compiled kernels' own metadata
        pytest.skip("compile-only check for machines without a GPU")
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "nvdisasm")):
        pytest.skip("the triton wheel's ptxas / nvdisasm are not installed")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])
