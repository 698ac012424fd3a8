"""Probe (issue 4): the Gated DeltaNet recurrence with the output fused, written in Gluon for sm90.

The Triton forward runs three kernels: intra (w, u, gamma, normalised k), the recurrence (h stored per chunk, v_new)
and the output kernel (reads h back). At B = 1 the recurrence has 128 programs and is issue-bound at one warp per
scheduler (~530 SASS instructions per chunk step and warp, NOTES session 24), so fusing the output into it made it
slower (the Triton fused step serialises five dots). Here the per-chunk tiles come by TMA into a ring of STAGES slots
(issued STAGES - 1 chunks ahead) and every product is a wgmma with its operands in shared memory (the state's bf16 copy,
w, q, k^T, v_new) or, for P, in registers, so a chunk step is two dependent levels of tensor-core work:

    level 1 (read S): w S, q S and q k^T (the last does not depend on S)
    level 2 (read v_new = u - w S): P v_new (P = q k^T * decay) and k^T diag(e^(g_last - g)) v_new (the state update)

with the rounding points of the Triton fused kernel (chunk.chunk_gated_delta_rule_fwd_kernel_h with FUSE_O): S cast to
the input dtype for its products, v_new and its decayed copy cast for theirs, P cast, o = scale (e^g q S + P v_new).
k arrives normalised (the intra kernel's kn); q is normalised in the kernel (L2NORM 1), or q S and q k^T are scaled by
q's row norms taken from the diagonal of q q^T (L2NORM 2: not the library's bits), or q comes normalised (0). The
chunk's gammas are loaded one chunk ahead; FTZ takes each exponential as one ex2.approx.ftz. One program per (V-block
of BV, sequence x value head), one warpgroup. Dense inputs with T % 64 == 0 only (a probe). Measured: NOTES, session 39
(1.16x / 0.92x / 1.11x / 1.16x the library's forward at the four bench shapes; not in the library).

    PYTHONPATH=. python3 benchmarks/gdn_fused_gluon.py OUT.json [--shapes 1x32768x16x32 ...] [--cfgs BV:STAGES ...]

Checks each config against the library's forward (o and the final state, relative RMS; and against the float64
recurrent reference at a small shape with an initial state and grouped heads), then times the forward (intra + this
kernel) against the library's (intra + recurrence + output, or its fused kernel where the library fuses).
"""

import argparse
import json
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bwd_sweep import rel_rms  # noqa: E402  (the probes' relative error)

BT = gl.constexpr(64)  # the chunk (in kernels)
BT_ = 64  # (on the host)


@gluon.jit
def _exp(x, FTZ: gl.constexpr):
    """e^x; FTZ: one ex2.approx.ftz (gl.exp's ex2 keeps denormal results: a compare, a select and two multiplies around
    each MUFU.EX2 in the SASS)."""
    if FTZ:
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634], gl.float32,
                                         True, 1)
    else:
        return gl.exp(x)


@gluon.jit
def _issue(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, ready, slot, row, col_w, col_k, col_v,
           nbytes: gl.constexpr):
    """One chunk's w, k, q and u tiles by TMA into ring slot ``slot`` (``ready[slot]`` counts their bytes)."""
    bar = ready.index(slot)
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(w_desc, [row, col_w], bar, w_s.index(slot))
    tma.async_copy_global_to_shared(k_desc, [row, col_k], bar, k_s.index(slot))
    tma.async_copy_global_to_shared(q_desc, [row, col_k], bar, q_s.index(slot))
    tma.async_copy_global_to_shared(u_desc, [row, col_v], bar, u_s.index(slot))


@gluon.jit
def gdn_fused_fwd_kernel(w_desc, k_desc, q_desc, u_desc, gamma_ptr, h0_ptr, ht_ptr, o_ptr, T, scale,
                         H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                         STAGES: gl.constexpr, L2NORM: gl.constexpr, USE_H0: gl.constexpr,
                         STORE_FINAL: gl.constexpr, FTZ: gl.constexpr = False):
    i_v = gl.program_id(0)
    i_nh = gl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    NT = T // BT
    row0 = i_n * T  # first token row of the [B T, heads dim] views
    col_v = i_hv * V + i_v * BV
    dtype: gl.constexpr = w_desc.dtype

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BV, 16])
    qk_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    blk_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    s_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], dtype)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BV], dtype)

    w_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], w_desc.layout)
    k_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], k_desc.layout)
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BT, K], q_desc.layout)
    u_s = gl.allocate_shared_memory(dtype, [STAGES, BT, BV], u_desc.layout)
    qn_s = gl.allocate_shared_memory(dtype, [BT, K], q_desc.layout)
    S_s = gl.allocate_shared_memory(dtype, [K, BV], s_sl)
    vn_s = gl.allocate_shared_memory(dtype, [BT, BV], v_sl)
    vs_s = gl.allocate_shared_memory(dtype, [BT, BV], v_sl)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    nbytes: gl.constexpr = 3 * BT * K * 2 + BT * BV * 2

    # the first STAGES - 1 chunks in flight
    for s in gl.static_range(STAGES - 1):
        if s < NT:
            _issue(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, ready, s, row0 + s * BT, i_hv * K, i_h * K,
                   col_v, nbytes)

    rows_k = gl.arange(0, K, layout=gl.SliceLayout(1, acc_l))
    cols_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, acc_l))
    o_state = i_nh.to(gl.int64) * K * V
    S = gl.zeros([K, BV], gl.float32, acc_l)
    if USE_H0:
        S = gl.load(h0_ptr + o_state + rows_k[:, None] * V + cols_v[None, :])
    S_s.store(S.to(dtype))
    fence_async_shared()

    t_acc = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_l))
    t_qk = gl.arange(0, BT, layout=gl.SliceLayout(1, qk_l))
    c_qk = gl.arange(0, BT, layout=gl.SliceLayout(0, qk_l))
    g_base = gamma_ptr + i_n.to(gl.int64) * T * HV + i_hv
    # the chunk's gammas are loaded one chunk ahead (their L2 latency was a third of the stalls: ncu, call 4)
    n_acc = gl.load(g_base + t_acc * HV)
    n_row = gl.load(g_base + t_qk * HV)
    n_col = gl.load(g_base + c_qk * HV)
    n_last = gl.load(g_base + (BT - 1) * HV)
    for i_t in range(NT):
        g_acc, g_row, g_col, g_last = n_acc, n_row, n_col, n_last
        t1 = gl.minimum(i_t + 1, NT - 1) * BT
        n_acc = gl.load(g_base + (t1 + t_acc) * HV)
        n_row = gl.load(g_base + (t1 + t_qk) * HV)
        n_col = gl.load(g_base + (t1 + c_qk) * HV)
        n_last = gl.load(g_base + (t1 + BT - 1) * HV)
        slot = i_t % STAGES
        # refill the slot freed by chunk i_t - 1 with chunk i_t + STAGES - 1
        nxt = i_t + STAGES - 1
        if nxt < NT:
            _issue(w_desc, k_desc, q_desc, u_desc, w_s, k_s, q_s, u_s, ready, nxt % STAGES, row0 + nxt * BT, i_hv * K,
                   i_h * K, col_v, nbytes)
        mbarrier.wait(ready.index(slot), (i_t // STAGES) & 1)
        if L2NORM == 1:  # q normalised in registers, stored back for the products
            qx = q_s.index(slot).load(blk_l).to(gl.float32)
            qx = qx * gl.rsqrt(gl.sum(qx * qx, 1) + 1e-6)[:, None]
            qn_s.store(qx.to(dtype))
            fence_async_shared()
            q_op = qn_s
        else:
            q_op = q_s.index(slot)
        # level 1: w S, q S, q k^T
        ws = warpgroup_mma(w_s.index(slot), S_s, gl.zeros([BT, BV], gl.float32, acc_l), use_acc=False,
                           is_async=True)
        qs = warpgroup_mma(q_op, S_s, gl.zeros([BT, BV], gl.float32, acc_l), use_acc=False, is_async=True)
        qk = warpgroup_mma(q_op, k_s.index(slot).permute((1, 0)), gl.zeros([BT, BT], gl.float32, qk_l),
                           use_acc=False, is_async=True)
        if L2NORM == 2:  # q's row norms from the diagonal of q q^T; q S and q k^T scaled by them afterwards
            qq = warpgroup_mma(q_op, q_op.permute((1, 0)), gl.zeros([BT, BT], gl.float32, qk_l), use_acc=False,
                               is_async=True)
            ws = warpgroup_mma_wait(3, deps=[ws])
        else:
            ws = warpgroup_mma_wait(2, deps=[ws])
        u = u_s.index(slot).load(acc_l).to(gl.float32)
        vn = u - ws
        vs = vn * _exp(g_last - g_acc, FTZ)[:, None]
        vn_s.store(vn.to(dtype))
        vs_s.store(vs.to(dtype))
        fence_async_shared()
        if L2NORM == 2:
            qs, qk, qq = warpgroup_mma_wait(0, deps=[qs, qk, qq])
            rn = gl.rsqrt(gl.sum(gl.where(t_qk[:, None] == c_qk[None, :], qq, 0.0), 1) + 1e-6)
            qk = qk * rn[:, None]
            qs = qs * gl.convert_layout(rn, gl.SliceLayout(1, acc_l))[:, None]
        else:
            qs, qk = warpgroup_mma_wait(0, deps=[qs, qk])
        keep = t_qk[:, None] >= c_qk[None, :]
        decay = _exp(gl.where(keep, g_row[:, None] - g_col[None, :], float("-inf")), FTZ)
        p = gl.convert_layout((qk * decay).to(dtype), p_l)
        o = qs * _exp(g_acc, FTZ)[:, None]
        # level 2: P v_new, k^T (decayed v_new) into the state
        o = warpgroup_mma(p, vn_s, o, is_async=True)
        S = S * _exp(g_last, FTZ)
        S = warpgroup_mma(k_s.index(slot).permute((1, 0)), vs_s, S, is_async=True)
        o, S = warpgroup_mma_wait(0, deps=[o, S])
        o_off = (row0 + i_t * BT + t_acc).to(gl.int64)[:, None] * (HV * V) + i_hv * V + cols_v[None, :]
        gl.store(o_ptr + o_off, (o * scale).to(dtype))
        S_s.store(S.to(dtype))
        fence_async_shared()
    if STORE_FINAL:
        gl.store(ht_ptr + o_state + rows_k[:, None] * V + cols_v[None, :], S)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))


def fused_forward(q, k, v, g, beta, scale, initial_state=None, l2norm=True, bv=32, stages=2, output_final_state=True,
                  qn=None, qmode=1, ftz=False):
    """(o, final_state): the library's intra kernel (w, u, gamma, kn), then the Gluon fused recurrence. ``qn``: q
    already l2-normalised (the kernel then skips its normalisation: a bound on what precomputing it would give)."""
    from triforge import launch
    from triforge.ops.deltanet import chunk as C

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert T % BT_ == 0 and K == 128 and V % bv == 0
    intra = C.chunk_fwd_intra(k, v, g, beta, l2norm=l2norm, store_kn=l2norm)
    w, u, gamma = intra["w"], intra["u"], intra["gamma"]
    kk = intra.get("kn", k)
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    lk = gl.NVMMASharedLayout.get_default_for([BT_, K], gdt)
    lv = gl.NVMMASharedLayout.get_default_for([BT_, bv], gdt)
    w_desc = TensorDescriptor.from_tensor(w.view(B * T, HV * K), [BT_, K], lk)
    k_desc = TensorDescriptor.from_tensor(kk.view(B * T, H * K), [BT_, K], lk)
    q_desc = TensorDescriptor.from_tensor((q if qn is None else qn).view(B * T, H * K), [BT_, K], lk)
    u_desc = TensorDescriptor.from_tensor(u.view(B * T, HV * V), [BT_, bv], lv)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(B, HV, K, V, dtype=torch.float32, device=v.device)
    h0 = initial_state if initial_state is not None else ht
    launch.launch("gdn_fused_gluon", gdn_fused_fwd_kernel, (V // bv, B * HV), w_desc, k_desc, q_desc, u_desc, gamma,
                  h0, ht, o, T, scale, H=H, HV=HV, K=K, V=V, BV=bv, STAGES=stages,
                  L2NORM=qmode if l2norm and qn is None else 0,
                  USE_H0=initial_state is not None, STORE_FINAL=output_final_state, FTZ=ftz, num_warps=4)
    return o, ht


def parse(spec):
    """BV:STAGES[:qn|:post][:ftz] (ftz: exponentials by ex2.approx.ftz; qn: q normalised beforehand, outside the timed
    call; post: the kernel scales q S and q k^T by q's row norms, taken from the diagonal of q q^T, instead of
    normalising q: L2NORM 2)."""
    parts = spec.split(":")
    return int(parts[0]), int(parts[1]), ("qn" if "qn" in parts[2:] else "post" if "post" in parts[2:] else None), \
        "ftz" in parts[2:]


def qnorm(q):
    """q l2-normalised in fp32 (the reference's l2norm), in q's dtype."""
    from triforge.ops.deltanet.reference import l2norm

    return l2norm(q.float()).to(q.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="*", default=["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"])
    ap.add_argument("--cfgs", nargs="*", default=["32:3", "32:3:ftz", "32:3:qn", "32:3:qn:ftz"],
                    help="BV:STAGES[:qn|:post][:ftz] (parse)")
    args = ap.parse_args()
    from triton.testing import do_bench

    from triforge.ops import deltanet as D
    from triforge.ops.deltanet import chunk as C
    from triforge.ops.deltanet import reference as R

    rows = []
    torch.manual_seed(0)
    # small-shape check against float64 (the library's recurrent reference), with an initial state and GQA
    B, T, H, HV = 2, 256, 2, 4
    q = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(B, T, HV, device="cuda") * 2
    beta = torch.rand(B, T, HV, device="cuda").to(torch.bfloat16)
    h0 = torch.randn(B, HV, 128, 128, device="cuda")
    ref_o, ref_s = C.chunk_fwd(q, k, v, g, beta, 128 ** -0.5, h0, l2norm=True, fuse_o=False)
    f64 = R.recurrent_ref(q, k, v, g, beta, 128 ** -0.5, h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for spec in args.cfgs:
        bv, st, pre, ftz = parse(spec)
        try:
            o, s = fused_forward(q, k, v, g, beta, 128 ** -0.5, h0, bv=bv, stages=st,
                                 qn=qnorm(q) if pre == "qn" else None, qmode=2 if pre == "post" else 1, ftz=ftz)
            torch.cuda.synchronize()
            r = {"check": "small", "cfg": spec, "o_vs_triton": rel_rms(o, ref_o), "s_vs_triton": rel_rms(s, ref_s),
                 "nan": bool(torch.isnan(o).any() or torch.isnan(s).any())}
            r.update(o_vs_f64=rel_rms(o, f64[0]), triton_o_vs_f64=rel_rms(ref_o, f64[0]), s_vs_f64=rel_rms(s, f64[1]),
                     triton_s_vs_f64=rel_rms(ref_s, f64[1]))
        except Exception as e:  # noqa: BLE001 (a probe: report and go on)
            r = {"check": "small", "cfg": spec, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(r, flush=True)
        rows.append(r)
    for shape in args.shapes:
        B, T, H, HV = (int(x) for x in shape.split("x"))
        inp = D._make_inputs("real", torch.bfloat16, "cuda", torch.Generator().manual_seed(0),
                             ((B, T, H, HV, 128, 128), (B, T, H, HV, 128, 128)))
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        scale = 128 ** -0.5
        ref_o, ref_s = C.chunk_fwd(q, k, v, g, beta, scale, None, l2norm=True)
        base_ms = do_bench(lambda: C.chunk_fwd(q, k, v, g, beta, scale, None, l2norm=True), warmup=25, rep=200,
                           return_mode="median")
        intra_ms = do_bench(lambda: C.chunk_fwd_intra(k, v, g, beta, l2norm=True, store_kn=True), warmup=25,
                            rep=200, return_mode="median")
        row = {"shape": shape, "library_ms": base_ms, "intra_ms": intra_ms, "cfgs": []}
        qn = qnorm(q)
        for spec in args.cfgs:
            bv, st, pre, ftz = parse(spec)
            try:
                kw = dict(bv=bv, stages=st, qn=qn if pre == "qn" else None, qmode=2 if pre == "post" else 1, ftz=ftz)
                o, s = fused_forward(q, k, v, g, beta, scale, None, **kw)
                torch.cuda.synchronize()
                ms = do_bench(lambda: fused_forward(q, k, v, g, beta, scale, None, **kw), warmup=25, rep=200,
                              return_mode="median")
                c = {"cfg": spec, "ms": ms, "o_vs_lib": rel_rms(o, ref_o), "s_vs_lib": rel_rms(s, ref_s),
                     "nan": bool(torch.isnan(o).any())}
            except Exception as e:  # noqa: BLE001
                c = {"cfg": spec, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            row["cfgs"].append(c)
            print(shape, c, flush=True)
        rows.append(row)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nshape            library ms   intra ms   best fused fwd ms (cfg)   speedup   (q pre-normalised: best ms)")
    for row in rows:
        if "shape" not in row:
            continue
        good = [c for c in row["cfgs"] if "ms" in c and not c["nan"] and c["o_vs_lib"] < 2e-2 and ":qn" not in c["cfg"]]
        if good:
            b = min(good, key=lambda c: c["ms"])
            pre = [c["ms"] for c in row["cfgs"] if "ms" in c and ":qn" in c["cfg"] and not c["nan"]]  # noqa: E501
            print(f"{row['shape']:16s} {row['library_ms']:9.3f} {row['intra_ms']:9.3f}   {b['ms']:9.3f} ({b['cfg']})"
                  f"   {row['library_ms'] / b['ms']:.2f}x   ({min(pre) if pre else float('nan'):.3f})")
        else:
            print(f"{row['shape']:16s} {row['library_ms']:9.3f}  no passing config")


if __name__ == "__main__":
    main()
