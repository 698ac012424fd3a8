"""A Gluon kernel built for sm90a without a GPU, in the TRITON_INTERPRET=0 subprocess that
tests/ops/attention/test_flash_attn._sm90_compile starts: its shared memory, ptxas's spill stores, whether ptxas
serialized the wgmma pipeline (C7515), and the wgmma count of its PTX."""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource


def compile_sm90(fn, types, consts, aligned, num_warps=4):
    """``fn`` with ``consts`` as constexprs, ``types`` for the other arguments (int32 where absent), the arguments
    named in ``aligned`` 16-byte aligned."""
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(k.asm["ptx"])
        v = subprocess.run([ptxas, "-v", "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "o.cubin")],
                           capture_output=True, text=True).stderr
    return dict(shared=k.metadata.shared, serialized="C7515" in v,
                spills=int(re.search(r"(\d+) bytes spill stores", v).group(1)),
                wgmma=k.asm["ptx"].count("wgmma.mma_async"))
