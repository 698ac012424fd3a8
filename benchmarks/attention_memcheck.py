"""The attention kernels with the sm90 configs at D = 64 and 128 on small odd shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck python3 benchmarks/attention_memcheck.py

`triforge check --tier tiny` covers D = 64 only; the tuned configs are per (D, causal, dtype), whatever the
lengths, so small odd lengths (partial blocks, Sq != Sk, GQA, varlen with an empty sequence) run the same
compiled kernels as the benchmark shapes. Each run is compared with float64 attention (relative RMS of o, dq,
dk, dv); the script exits 1 if any is off or non-finite.
"""

import sys

import torch

from triforge import flash_attn_func, flash_attn_varlen_func
from triforge.ops.attention import attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter (slow; a check of this script)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(tag, run, ref, leaves, do):
    o = run(*leaves)
    grads = torch.autograd.grad(o, leaves, do)
    o64 = ref([t.detach().double().requires_grad_(True) for t in leaves])
    errs = [rel(o, o64[0])] + [rel(g, r) for g, r in zip(grads, o64[1])]
    ok = all(e == e and e < 2e-2 for e in errs)
    print(f"{tag}: {'ok' if ok else 'WRONG'} " + " ".join(f"{e:.1e}" for e in errs), flush=True)
    return ok


def main():
    torch.manual_seed(0)
    dt = torch.bfloat16
    ok = True
    for D in (64, 128):
        for causal in (False, True):
            B, Sq, Sk, H, Hkv = 2, 301, 333, 4, 2
            q = torch.randn(B, Sq, H, D, device=DEV, dtype=dt)
            k = torch.randn(B, Sk, Hkv, D, device=DEV, dtype=dt)
            v = torch.randn(B, Sk, Hkv, D, device=DEV, dtype=dt)
            do = torch.randn(B, Sq, H, D, device=DEV, dtype=dt)

            def ref(ls, causal=causal, do=do):
                o = attention_ref(*ls, causal)["o"]
                return o, torch.autograd.grad(o, ls, do.double())

            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            ok &= check(f"D={D} causal={causal}", lambda q, k, v, c=causal: flash_attn_func(q, k, v, causal=c), ref,
                        leaves, do)
        lens = [37, 0, 129, 1, 200]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=DEV, dtype=torch.int32)
        T, H = sum(lens), 4
        q, k, v, do = (torch.randn(T, H, D, device=DEV, dtype=dt) for _ in range(4))

        def ref_vl(ls, do=do):
            outs = []
            for i, n in enumerate(lens):
                s = slice(int(cu[i]), int(cu[i + 1]))
                outs.append(attention_ref(*(t[s].unsqueeze(0) for t in ls), True)["o"][0] if n else ls[0][s] * 0)
            o = torch.cat(outs)
            return o, torch.autograd.grad(o, ls, do.double(), allow_unused=True)

        leaves = [t.requires_grad_(True) for t in (q, k, v)]
        ok &= check(f"D={D} varlen causal",
                    lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True),
                    ref_vl, leaves, do)
    if DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        ok &= persistent_walks()
        torch.cuda.synchronize()
    sys.exit(0 if ok else 1)


def persistent_walks():
    """The persistent Gluon forward (forward_ws.py, PERSIST) with 3 programs, so that each walks many work items (the
    library's launches give one item to each program at these lengths), causal and not, with XITEM 0 / 1 / 2."""
    from triforge.ops.attention.forward_ws import attn_fwd_ws

    ok = True
    for D, cfg in ((64, {"BLOCK_N": 128, "num_stages": 4, "NUM_WG": 3, "SCHED": 1}),
                   (128, {"BLOCK_N": 128, "num_stages": 2})):
        for causal in (False, True):
            for xitem in (0, 1, 2):
                q, k, v = (torch.randn(2, n, h, D, device=DEV, dtype=torch.bfloat16)
                           for n, h in ((301, 4), (333, 2), (333, 2)))
                o, _, _ = attn_fwd_ws(q, k, v, causal, D ** -0.5, dict(cfg, PERSIST=1, PROGRAMS=3, XITEM=xitem))
                e = rel(o, attention_ref(q.double(), k.double(), v.double(), causal)["o"])
                good = e == e and e < 2e-2
                print(f"persistent D={D} causal={causal} XITEM={xitem}: {'ok' if good else 'WRONG'} {e:.1e}", flush=True)
                ok &= good
    return ok


if __name__ == "__main__":
    main()
