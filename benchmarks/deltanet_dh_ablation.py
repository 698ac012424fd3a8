"""What the Gated DeltaNet backward's reverse recurrence (kernel 1, dh) would gain if its state-independent products
came from a buffer (issue 4): an ablation, not a kernel to ship.

Each chunk step of ``chunk_bwd.chunk_gated_delta_rule_bwd_kernel_dh`` runs five tensor-core products in series
(Triton 3.6 waits on each wgmma where it is not a loop-carried accumulator); two do not depend on the state
gradient: P^T = (K Q^T) * decay (recomputed by every V-block program) and P^T dO. Variants of a copy of the kernel,
timed at the bench shapes with their sm90.json configs:

- ``full``: the kernel as shipped (the copy; its outputs are checked against the library's);
- ``load_p``: P^T read as a [BT, BT] 16-bit tile per chunk (what a forward that stored P would give);
- ``load_dvl``: P^T dO * scale read as a [BT, BV] 16-bit tile (what a parallel pre-kernel would give).

The loaded buffers hold random values (timing only). If ``load_p`` is not clearly faster, storing P in the forward
cannot pay for itself.

    PYTHONPATH=. python benchmarks/deltanet_dh_ablation.py [--shapes 8x4096x16x32 1x32768x16x32] [--json PATH]
"""

import argparse
import json

import torch
import triton
import triton.language as tl

from triforge import bench
from triforge.ops._tl import cast as _cast
from triforge.ops.deltanet import chunk_bwd
from triforge.ops.deltanet.chunk import _dot, _flags, _state_program


@triton.jit
def _dh_variant(q_ptr, k_ptr, w_ptr, gamma_ptr, do_ptr, dh_ptr, dv_new_ptr, p_ptr, dvl_ptr, T, scale,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BV: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, RNE: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_hv, i_h, bos, seq_len, boh, NT = _state_program(i_nh, T, i_nh, i_nh, H, HV, BT, False)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_dS = tl.zeros([K, BV], dtype=tl.float32)
    for i_s in range(NT):
        i_t = NT - 1 - i_s
        o_t = i_t * BT + o_i
        m_t = o_t < seq_len
        o_row = bos + o_t.to(tl.int64)
        m_tv = m_t[:, None] & m_v[None, :]
        o_h = ((boh + i_t) * HV + i_hv) * K * V
        tl.store(dh_ptr + o_h + o_kv, _cast(b_dS, dh_ptr.dtype.element_ty, RNE), mask=m_v[None, :])
        o_qk = (o_row * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q_ptr + o_qk, mask=m_t[:, None], other=0.0)
        b_k = tl.load(k_ptr + o_qk, mask=m_t[:, None], other=0.0)
        b_w = tl.load(w_ptr + (o_row * HV + i_hv)[:, None] * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_gamma = tl.load(gamma_ptr + o_row * HV + i_hv, mask=m_t, other=0.0)
        last = tl.minimum(i_t * BT + BT, seq_len) - 1
        b_glast = tl.load(gamma_ptr + (bos + last) * HV + i_hv)
        o_vrow = (o_row * HV + i_hv)[:, None] * V + o_v[None, :]
        b_do = tl.load(do_ptr + o_vrow, mask=m_tv, other=0.0)
        if MODE == 0:
            o_j = tl.arange(0, BT)
            m_keep = (o_j[:, None] <= o_j[None, :]) & m_t[:, None] & m_t[None, :]
            b_pt = _dot(b_k, tl.trans(b_q), None, PREC, UPCAST) * tl.exp(
                tl.where(m_keep, b_gamma[None, :] - b_gamma[:, None], float("-inf")))
            b_dvn = _dot(_cast(b_pt, b_do.dtype, RNE), b_do, None, PREC, UPCAST) * scale
        elif MODE == 1:
            b_pt = tl.load(p_ptr + (o_row * HV + i_hv)[:, None] * BT + o_i[None, :], mask=m_t[:, None], other=0.0)
            b_dvn = _dot(b_pt, b_do, None, PREC, UPCAST) * scale
        else:
            b_dvn = tl.load(dvl_ptr + o_vrow, mask=m_tv, other=0.0).to(tl.float32)
        b_l = tl.exp(tl.where(m_t, b_glast - b_gamma, float("-inf")))
        b_dvn += _dot(b_k, _cast(b_dS, b_k.dtype, RNE), None, PREC, UPCAST) * b_l[:, None]
        tl.store(dv_new_ptr + o_vrow, _cast(b_dvn, dv_new_ptr.dtype.element_ty, RNE), mask=m_tv)
        b_e = tl.exp(tl.where(m_t, b_gamma, float("-inf")))
        b_doe = _cast(b_do.to(tl.float32) * (b_e * scale)[:, None], b_q.dtype, RNE)
        b_dS = b_dS * tl.exp(b_glast)
        b_dS = _dot(tl.trans(b_q), b_doe, b_dS, PREC, UPCAST)
        b_dS = _dot(tl.trans(b_w), _cast(-b_dvn, b_w.dtype, RNE), b_dS, PREC, UPCAST)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["8x4096x16x32", "1x32768x16x32", "1x8192x32x32"])
    ap.add_argument("--json")
    args = ap.parse_args()
    import sys
    sys.path.insert(0, "benchmarks")
    from deltanet_dh_probe import setup_tensors  # noqa: E402  (the dh kernel's inputs from a saving forward)

    rows = []
    for shape in args.shapes:
        B, T, H, HV = (int(v) for v in shape.split("x"))
        qn, kn, w, gamma, do, scale, _ = setup_tensors(B, T, H, HV)
        lib = chunk_bwd.chunk_bwd_dh(qn, kn, w, gamma, do, None, scale)
        K, V = qn.shape[3], do.shape[3]
        cfg = chunk_bwd.bwd_config("gated_delta_rule_bwd_dh", K, V, qn.dtype, B * HV)
        NT = triton.cdiv(T, 64)
        p = torch.randn(B, T, HV, 64, device="cuda", dtype=qn.dtype) * 0.1
        dvl = torch.randn(B, T, HV, V, device="cuda", dtype=qn.dtype) * 0.1
        row = {"shape": shape, "cfg": cfg, "us": {}}
        for mode, name in ((0, "full"), (1, "load_p"), (2, "load_dvl")):
            dh = torch.empty(B, NT, HV, K, V, device="cuda", dtype=qn.dtype)
            dvn = torch.empty(B, T, HV, V, device="cuda", dtype=qn.dtype)

            def call(mode=mode, dh=dh, dvn=dvn):
                _dh_variant[(V // cfg["BV"], B * HV)](qn, kn, w, gamma, do, dh, dvn, p, dvl, T, scale, H=H, HV=HV, K=K,
                                                      V=V, BT=64, BV=cfg["BV"], MODE=mode, **_flags(qn.dtype),
                                                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            call()
            if mode == 0:
                ok = torch.equal(dh, lib[0]) and torch.equal(dvn, lib[1])
                row["copy_equals_library"] = ok
            row["us"][name] = bench.time_ms(call)["median_ms"] * 1e3
        row["us"]["library"] = bench.time_ms(lambda: chunk_bwd.chunk_bwd_dh(qn, kn, w, gamma, do, None, scale))[
            "median_ms"] * 1e3
        print(f"{shape} ({cfg}): " + "; ".join(f"{k} {v:.1f} us" for k, v in row["us"].items())
              + f"; copy == library: {row['copy_equals_library']}", flush=True)
        rows.append(row)
        del lib, p, dvl
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
