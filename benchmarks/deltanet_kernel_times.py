"""Where the Gated DeltaNet forward and backward spend their GPU time, kernel by kernel (issue 4).

At each bench shape (bf16, K = V = 128, l2norm in the kernel, an initial state, the final state out: the bench's
inputs), the public op's forward (under no_grad, and differentiable: it then keeps the backward's residuals unless
TRIFORGE_DELTANET_SAVE=0) and its backward (``torch.autograd.grad`` of o and the final state) run under
torch.profiler after a warm-up; each CUDA kernel's time is summed over the profiled iterations and divided by
their number. The backward's rows show how much of it recomputes the forward (the intra and state kernels).

    PYTHONPATH=. python benchmarks/deltanet_kernel_times.py [--shapes 1x32768x16x32 ...] [--iters 5] [--json PATH]

``--spec-t``: every DeltaNet kernel that still passes ``do_not_specialize=["T"]`` (since session 32 the backward's dh
kernel and the fused recurrent decode kernel) compiled with T specialised: run once with and once without, in two
processes, to see what the specialisation is worth.

``--mhc C ...``: the same for mHC-lite's K1 (fused RMSNorm + projection, issue 5) at T = 65536: its forward and
backward kernels (the backward's prologue, streaming kernel and reduce) one by one.
"""

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import triforge
from triforge.ops import deltanet as D

SHAPES = ["1x32768x16x32", "8x4096x16x32", "4x8192x16x16", "1x8192x32x32"]


def specialise_t():
    """Rebind each DeltaNet kernel that leaves T unspecialised to a copy that specialises it (before any launch)."""
    import triton
    from triton.runtime.jit import JITFunction

    from triforge.ops.deltanet import chunk, chunk_bwd, fused_recurrent

    names = []
    for mod in (chunk, chunk_bwd, fused_recurrent):
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and obj.do_not_specialize:
                setattr(mod, name, triton.jit(obj.fn))
                names.append(name)
    print(f"T specialised in {len(names)} kernels: {', '.join(names)}", flush=True)
    return names


def inputs(B, T, H, HV, gen):
    ins = D._make_inputs({"B": B, "T": T, "H": H, "HV": HV}, torch.bfloat16, "cuda", gen, None)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        ins[name].requires_grad_(True)
    return ins


def kernel_times(fn, iters):
    """{kernel name: microseconds per iteration} of fn's CUDA kernels, and the sum."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name] += ev.device_time / iters  # microseconds
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def show(*labelled):
    """One line per kernel of each (label, {kernel: us}) pass."""
    for label, times in labelled:
        for name, us in times.items():
            print(f"   {label} {us:8.1f} us  {name[:90]}")


def mhc_rows(cs, iters):
    from triforge.ops import mhc as M

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for C in cs:
        T = 65536
        x = torch.randn(T, 4 * C, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
        W = (0.02 * torch.randn(32, 4 * C, device="cuda", generator=gen)).requires_grad_(True)
        proj, inv = M.fused_rmsnorm_project(x, W)
        dp, di = torch.randn_like(proj), torch.randn_like(inv)

        def fwd():
            with torch.no_grad():
                M.fused_rmsnorm_project(x, W)

        def bwd():
            torch.autograd.grad((proj, inv), (x, W), (dp, di), retain_graph=True)

        f, b = kernel_times(fwd, iters), kernel_times(bwd, iters)
        stream = T * 4 * C * 2
        print(f"mHC K1 T={T} C={C}: forward {sum(f.values()):.1f} us (x once: {stream / 3.0e6:.1f} us at 3.0 TB/s), "
              f"backward {sum(b.values()):.1f} us (x and dx: {2 * stream / 3.0e6:.1f} us)", flush=True)
        show(("fwd", f), ("bwd", b))
        rows.append({"mhc_C": C, "fwd_us": f, "bwd_us": b})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mhc", nargs="*", type=int, default=None, help="mHC K1 at these C instead (T = 65536)")
    ap.add_argument("--shapes", nargs="*", default=SHAPES)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--spec-t", action="store_true", help="compile the DeltaNet kernels with T specialised")
    args = ap.parse_args()
    if args.spec_t:
        specialise_t()
    gen = torch.Generator().manual_seed(0)
    rows = []
    if args.mhc:
        rows = mhc_rows(args.mhc, args.iters)
        args.shapes = []
    for s in args.shapes:
        B, T, H, HV = (int(v) for v in s.split("x"))
        ins = inputs(B, T, H, HV, gen)
        call = {k: v for k, v in ins.items()}

        def fwd():
            with torch.no_grad():
                triforge.chunk_gated_delta_rule(**call)

        def fwd_train():  # differentiable: keeps the backward's residuals unless TRIFORGE_DELTANET_SAVE=0
            triforge.chunk_gated_delta_rule(**call)

        o, final = triforge.chunk_gated_delta_rule(**call)
        do, dfinal = torch.randn_like(o), torch.randn_like(final)
        leaves = [ins[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]

        def bwd():
            torch.autograd.grad((o, final), leaves, (do, dfinal), retain_graph=True)

        f, ftr, b = kernel_times(fwd, args.iters), kernel_times(fwd_train, args.iters), kernel_times(bwd, args.iters)
        ft, ftrt, bt = sum(f.values()), sum(ftr.values()), sum(b.values())
        print(f"B={B} T={T} H={H} HV={HV}: forward {ft:.0f} us (differentiable: {ftrt:.0f}), backward {bt:.0f} us "
              f"({bt / ft:.2f}x the forward, {bt / ftrt:.2f}x the differentiable one)", flush=True)
        show(("fwd", f), ("fwd(grad)", ftr), ("bwd", b))
        rows.append({"shape": s, "fwd_us": f, "fwd_grad_us": ftr, "bwd_us": b, "fwd_total_us": ft, "fwd_grad_total_us": ftrt,
                     "bwd_total_us": bt})
        del ins, call, o, final, do, dfinal, leaves
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
