"""Does programmatic dependent launch (PDL) pay for a decode step's chain of small GEMVs on the H100?

A chain shaped like Qwen2.5-0.5B's MLP (24 x [gate/up-like 9728 x 896, then down-like 896 x 4864],
bf16, M = 1; each GEMV's input is the previous one's output) captured in one CUDA graph, timed by
replaying it, in three forms of one kernel:
  plain     no PDL
  pdl       launched with launch_pdl=True; griddepcontrol.wait before the first read of x
  pdl+pre   as pdl, and the program's first weight tile is loaded BEFORE the wait (weights never
            depend on the previous kernel), so the next GEMV's weight fetch overlaps this one's tail
Each form's chain output is checked against torch (fp32 math on the same bf16 weights). Byte floor:
the chain's weight bytes at the measured copy bandwidth.

    PYTHONPATH=. python benchmarks/pdl_probe.py [--json PATH]
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from triforge import bench


@triton.jit
def gemv_probe_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr, PRE: tl.constexpr):
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_k0 = tl.arange(0, BLOCK_K)
    p_w = w_ptr + o_n.to(tl.int64)[:, None] * K + o_k0[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRE:
        b_w0 = tl.load(p_w, mask=m_n[:, None] & (o_k0 < K)[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + o_k0
        m_k = o_k < K
        if PRE:
            if k0 == 0:
                b_w = b_w0
            else:
                b_w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)
        else:
            b_w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x = tl.load(x_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)
        acc += b_w.to(tl.float32) * b_x[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + o_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=m_n)


def gemv(x, w, y, bn, bk, pdl, pre, warps=4):
    N, K = w.shape
    gemv_probe_kernel[(triton.cdiv(N, bn),)](x, w, y, N, K, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl, PRE=pre,
                                            num_warps=warps, launch_pdl=pdl)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--layers", type=int, default=24)
    args = p.parse_args()
    dt = torch.bfloat16
    L = args.layers
    C, I2, I = 896, 9728, 4864
    wa = [torch.randn(I2, C, device="cuda", dtype=dt) * C ** -0.5 for _ in range(L)]
    wb = [torch.randn(C, I, device="cuda", dtype=dt) * I ** -0.5 for _ in range(L)]
    x0 = torch.randn(C, device="cuda", dtype=dt)
    ya = torch.empty(I2, device="cuda", dtype=dt)
    yb = torch.empty(C, device="cuda", dtype=dt)
    wbytes = sum(w.numel() * 2 for w in wa + wb)
    copy = bench.peaks()["copy_tbps"] * 1e12

    # reference chain, rounding to bf16 where the kernels store
    xr = x0
    for i in range(L):
        a = (wa[i].float() @ xr.float()).to(dt)
        xr = (wb[i].float() @ a[:I].float()).to(dt)

    cfgs = {"a": (8, 1024), "b": (2, 1024)}
    rows = []
    for form, (pdl, pre) in {"plain": (False, False), "pdl": (True, False), "pdl+pre": (True, True)}.items():
        for wa_cfg in ((8, 1024), (4, 1024), (16, 1024)):
            for wb_cfg in ((2, 1024), (4, 512), (1, 2048)):
                cfgs = {"a": wa_cfg, "b": wb_cfg}

                def chain():
                    x = x0
                    for i in range(L):
                        gemv(x, wa[i], ya, *cfgs["a"], pdl, pre)
                        gemv(ya[:I], wb[i], yb, *cfgs["b"], pdl, pre)
                        x = yb
                    return yb

                try:
                    out = chain().clone()
                    torch.cuda.synchronize()
                    err = ((out.float() - xr.float()).abs().max() / xr.float().abs().max()).item()
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        chain()
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        chain()
                    g.replay()
                    torch.cuda.synchronize()
                    out_g = yb.clone()
                    err_g = ((out_g.float() - xr.float()).abs().max() / xr.float().abs().max()).item()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    times = []
                    for _ in range(50):
                        start.record()
                        g.replay()
                        end.record()
                        torch.cuda.synchronize()
                        times.append(start.elapsed_time(end))
                    times.sort()
                    t = times[len(times) // 2]
                    rows.append({"form": form, "cfg_a": wa_cfg, "cfg_b": wb_cfg, "graph_us": 1e3 * t,
                                 "per_layer_us": 1e3 * t / L, "pct_copy": 100 * wbytes / (t * 1e-3) / copy,
                                 "rel_err_eager": err, "rel_err_graph": err_g})
                except Exception as e:
                    rows.append({"form": form, "cfg_a": wa_cfg, "cfg_b": wb_cfg, "error": repr(e)[:200]})
    for r in rows:
        if "error" in r:
            print(f"{r['form']:<8} a{r['cfg_a']} b{r['cfg_b']} ERROR {r['error']}")
        else:
            print(f"{r['form']:<8} a{r['cfg_a']} b{r['cfg_b']} {r['graph_us']:8.1f} us  {r['per_layer_us']:6.2f} us/layer "
                  f"{r['pct_copy']:5.1f}% copy  err {r['rel_err_eager']:.1e}/{r['rel_err_graph']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "weight_bytes": wbytes, "copy_Bps": copy, "device": torch.cuda.get_device_name()},
                      f, indent=1)


if __name__ == "__main__":
    main()
