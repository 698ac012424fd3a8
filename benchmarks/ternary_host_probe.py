"""Where the time of ``ternary.matmul`` at batch 1 goes (issue 6): host time per layer of the call
path and GPU time with the host taken out.

The bench measured 50 us per M = 1 call at 8192^2 while ncu timed the GEMV kernel at 17.8 us. do_bench
flushes L2 (a ~85 us memset) before each timed call, so a host path longer than the flush shows up in
the timing. This probe measures, per call:
- host us (perf_counter over many calls on a small shape, so the GPU never limits) of each layer:
  the public matmul, the launcher, each Triton launch through the JIT, the same launch through the
  compiled kernel's own launcher, and torch's cuBLAS matmul;
- GPU us at the bench shapes: do_bench as the bench runs it, and CUDA-graph replay (16 calls over 4
  weight sets that do not fit in L2 together), ours and cuBLAS fp16 side by side.

    PYTHONPATH=. python benchmarks/ternary_host_probe.py [--json PATH]
"""

import argparse
import json

import torch
import triton
import triton.testing

from triforge import launch
from triforge.ops import ternary as T
from triforge.ops.ternary import kernels as TK
from triforge.ops.ternary.tensor import TernaryTensor


def host_layers(N, K):
    from host_overhead_probe import host_us  # this script runs from benchmarks/

    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    tt = TernaryTensor.from_float(torch.randn(N, K, device="cuda"), method="absmean")
    w16 = tt.to_float(torch.float16)
    x16 = x.to(torch.float16)
    scales = tt.row_scales()
    y = T.matmul(x, tt)
    ref = x.double() @ tt.to_float(torch.float64).T
    err = (y.double() - ref).abs().max().item()
    cfg = TK._gemv_config(1, N, K)
    bw, bn = cfg["BLOCK_W"], cfg["BLOCK_N"]
    KW = tt.plus.shape[1]
    n_steps, n_blocks = triton.cdiv(KW, bw), triton.cdiv(N, bn)
    xt = torch.empty((n_steps, 32, 1, bw), device="cuda", dtype=torch.float32)
    out = torch.empty((1, N), device="cuda", dtype=torch.bfloat16)
    bm_args = (x, xt, 1, K)
    bm_kw = dict(BLOCK_M=1, BLOCK_W=bw, num_warps=4)
    gv_args = (xt, tt.plus, tt.minus, tt.plus, scales, scales, out, scales.stride(0), TK.MAGIC_2_23.value, 1, N, KW,
               triton.cdiv(KW, TK.CHUNK_WORDS), n_steps)
    gv_kw = dict(BLOCK_M=1, BLOCK_N=bn, BLOCK_W=bw, BIT_UNROLL=cfg["BIT_UNROLL"], SKIP=False, FINAL=True,
                 HAS_BIAS=False, RNE=False, num_warps=cfg["num_warps"])
    TK.ternary_gemv_bitmajor_kernel[(n_steps, 1)](*bm_args, **bm_kw)  # xt: x bit-major, which the GEMV reads
    ck = TK.ternary_gemv_kernel[(n_blocks, 1)](*gv_args, **gv_kw)
    all_args = list(gv_args) + [gv_kw[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_W", "BIT_UNROLL", "SKIP", "FINAL",
                                                   "HAS_BIAS", "RNE")]
    stream = torch.cuda.current_stream().cuda_stream
    ck._init_handles()

    def direct():
        ck.run(n_blocks, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *all_args)

    direct()
    torch.cuda.synchronize()
    # one split here (the launcher may split K at small N): equal to the fp64 product up to rounding, not bitwise
    assert (out.double() - ref).abs().max().item() <= 2 * err + 1e-2 * ref.abs().max().item(), "direct launch is wrong"
    rows = {
        "torch.empty(1, N)": host_us(lambda: torch.empty((1, N), device="cuda", dtype=torch.bfloat16)),
        "cuBLAS: x.to(fp16) @ w16.T": host_us(lambda: x.to(torch.float16) @ w16.T),
        "cuBLAS: x16 @ w16.T": host_us(lambda: x16 @ w16.T),
        "ternary.matmul (public)": host_us(lambda: T.matmul(x, tt)),
        "checks + dispatch": host_us(lambda: (T._check_ternary("tt", tt), T._check_activation("x", x, K, tt.device),
                                              T._dispatch(x, tt), tt.kernel_operands())),
        "ternary_gemv (launcher)": host_us(lambda: TK.ternary_gemv(x, tt.plus, tt.minus, scales)),
        "launch.config lookup": host_us(lambda: TK._gemv_config(1, N, K)),
        "bitmajor: jit_fn[grid](...)": host_us(lambda: TK.ternary_gemv_bitmajor_kernel[(n_steps, 1)](*bm_args, **bm_kw)),
        "gemv: jit_fn[grid](...)": host_us(lambda: TK.ternary_gemv_kernel[(n_blocks, 1)](*gv_args, **gv_kw)),
        "gemv: launch.launch(...)": host_us(lambda: launch.launch("ternary_gemv", TK.ternary_gemv_kernel, (n_blocks, 1),
                                                                  *gv_args, nbytes=1, **gv_kw)),
        "gemv: compiled.run (direct)": host_us(direct),
    }
    return {"N": N, "K": K, "max_abs_err_vs_fp64": err, "host_us": rows}


def graph_us(fn, sets, calls=16):
    """GPU us per call: ``calls`` calls cycling over ``sets`` captured in one CUDA graph, replayed."""
    from rope_probe import graphed  # this script runs from benchmarks/

    replay = graphed(lambda: [fn(*sets[i % len(sets)]) for i in range(calls)])
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def gpu_shapes(shapes, n_sets=4):
    out = []
    for M, N, K in shapes:
        sets, sets16 = [], []
        for _ in range(n_sets):
            tt = TernaryTensor.from_float(torch.randn(N, K, device="cuda"), method="absmean")
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            sets.append((x, tt))
            sets16.append((x.to(torch.float16), tt.to_float(torch.float16)))
        ours = lambda x, tt: T.matmul(x, tt)
        cublas = lambda x16, w16: x16 @ w16.T
        state = {"i": 0}

        def rot(fn, ss):
            def run():
                s = ss[state["i"] % len(ss)]
                state["i"] += 1
                return fn(*s)
            return run

        row = {"M": M, "N": N, "K": K}
        for name, fn, ss in (("triforge", ours, sets), ("cublas_fp16", cublas, sets16)):
            t = sorted(triton.testing.do_bench(rot(fn, ss), warmup=25, rep=200, return_mode="all"))
            row[f"{name}_do_bench_us"] = 1e3 * t[len(t) // 2]
            row[f"{name}_graph_us"] = graph_us(fn, ss)
        row["speedup_do_bench"] = row["cublas_fp16_do_bench_us"] / row["triforge_do_bench_us"]
        row["speedup_graph"] = row["cublas_fp16_graph_us"] / row["triforge_graph_us"]
        out.append(row)
        print(row, flush=True)
        del sets, sets16
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="1x8192x8192,1x28672x8192,1x8192x28672,4x8192x8192,16x8192x8192")
    a = ap.parse_args()
    res = {"host_small": host_layers(1024, 1024), "host_real": host_layers(8192, 8192)}
    for k, v in res.items():
        print(k, "err", v["max_abs_err_vs_fp64"])
        for name, us in v["host_us"].items():
            print(f"  {name:40s} {us:8.1f} us")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    res["gpu"] = gpu_shapes(shapes)
    print(f"{'M x N x K':>20s} {'ours do_bench':>14s} {'cuBLAS do_bench':>16s} {'x':>6s} {'ours graph':>11s} "
          f"{'cuBLAS graph':>13s} {'x':>6s}")
    for r in res["gpu"]:
        print(f"{r['M']:>6d}x{r['N']}x{r['K']:<6d} {r['triforge_do_bench_us']:14.1f} {r['cublas_fp16_do_bench_us']:16.1f} "
              f"{r['speedup_do_bench']:6.2f} {r['triforge_graph_us']:11.1f} {r['cublas_fp16_graph_us']:13.1f} "
              f"{r['speedup_graph']:6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
