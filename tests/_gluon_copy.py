"""A minimal Gluon kernel for tests/test_launch.py's GPU test of the launch fast path with TMA descriptors: one
program copies a [BM, BN] tile, read by TMA into shared memory, to a row-major output. Imported only on a GPU (the
interpreter does not run Gluon)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def tma_copy_kernel(desc, out_ptr, n_rows, n_cols, scale, BM: gl.constexpr, BN: gl.constexpr):
    pid = gl.program_id(0)
    smem = gl.allocate_shared_memory(desc.dtype, [BM, BN], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [pid * BM, 0], bar, smem)
    mbarrier.wait(bar, 0)
    mbarrier.invalidate(bar)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    x = smem.load(blk).to(gl.float32) * scale
    rows = pid * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, blk))
    m = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    gl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], x, mask=m)
