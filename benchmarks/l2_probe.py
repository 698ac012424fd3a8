"""Does an L2 hit cost as much time as a DRAM byte on this GPU? (session 49's L2 model, benchmarks/NOTES.md)

One persistent streaming kernel reads a large array X once (DRAM) and, per tile of X, a slice of a small array S
that stays in L2 (hits); FRAC is the hit bytes per X byte (0, 1/8, 1/4, 1/2, 1). A torch copy of X gives the
copy rate. If time grows with X + hits, the L2's throughput is the limit (every hit costs like a DRAM byte); if it
stays at X's time, hits are free and the mHC kernels' shortfall lies elsewhere.

    PYTHONPATH=. python benchmarks/l2_probe.py [--gb 2] [--json PATH]
    (on the CPU: --tiny runs the kernel once through the interpreter and checks its sum)
"""

import argparse
import json

import triforge  # noqa: F401,I001  (first: sets the interpreter up before triton is imported)
import torch
import triton
import triton.language as tl

from triforge import _runtime, bench


@triton.jit
def _stream_kernel(x_ptr, s_ptr, out_ptr, n_tiles, s_tiles, BLOCK: tl.constexpr, SB: tl.constexpr,
                   HITS: tl.constexpr):
    """Program p sums X's tiles p, p + P, ... (BLOCK elements each) and, with HITS, an SB-element slice of S per tile
    (S has s_tiles slices: a few MB, L2-resident after the first pass)."""
    pid = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    o_s = tl.arange(0, SB)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc_s = tl.zeros([SB], dtype=tl.float32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        acc += tl.load(x_ptr + t * BLOCK + o).to(tl.float32)  # (int32 offsets: X < 2^31 elements)
        if HITS:
            acc_s += tl.load(s_ptr + (t % s_tiles) * SB + o_s).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0) + tl.sum(acc_s, axis=0))


def run(x, s, frac, programs, block=8192):
    sb = max(16, int(block * frac)) if frac else 16
    n_tiles = x.numel() // block
    s_tiles = s.numel() // sb
    out = torch.empty(programs, device=x.device, dtype=torch.float32)
    _stream_kernel[(programs,)](x, s, out, n_tiles, s_tiles, BLOCK=block, SB=sb, HITS=bool(frac), num_warps=8)
    return out


def sm_mhz():
    """The SM clock now (MHz) or None (bench.sm_clock_mhz): an L2-bound kernel's time follows the clock that the L2
    runs at (ncu saw 1.73 GHz under load, the H200's boost is 1.98)."""
    return bench.sm_clock_mhz()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of X in GB (bf16)")
    ap.add_argument("--s-mb", type=float, default=8.0, help="size of S in MB (stays in L2)")
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true", help="one interpreter run with a checked sum (CPU)")
    args = ap.parse_args()
    if args.tiny:
        block = 64
        x = torch.randn(block * 10, dtype=torch.bfloat16)
        s = torch.randn(64, dtype=torch.bfloat16)
        out = run(x, s, 0.25, 3, block=block)
        want = x.float().sum() + sum(s[(t % 4) * 16:(t % 4) * 16 + 16].float().sum() for t in range(10))
        assert torch.isclose(out.sum(), want, rtol=1e-4, atol=1e-3), (out.sum(), want)
        print("tiny: ok")
        return
    _runtime.require_gpu("l2_probe")
    block = 8192
    n = int(args.gb * 1e9 / 2) // block * block
    assert n < 2**31, "--gb: at most 4 GB (the kernel's offsets are int32)"
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(int(args.s_mb * 1e6 / 2) // block * block, device="cuda", dtype=torch.bfloat16)
    programs = _runtime.num_sms() * 4
    peaks = bench.peaks()
    y = torch.empty_like(x)
    copy_ms = bench.time_ms(lambda: y.copy_(x))["median_ms"]
    rows = [{"what": "copy (read + write)", "ms": copy_ms, "dram_tbps": 2 * x.nbytes / copy_ms / 1e9,
             "l2_tbps": 2 * x.nbytes / copy_ms / 1e9, "sm_mhz": sm_mhz()}]
    for frac in (0, 0.125, 0.25, 0.5, 1.0):
        ms = bench.time_ms(lambda f=frac: run(x, s, f, programs))["median_ms"]
        hits = x.nbytes * frac
        rows.append({"what": f"read X + hits {frac:g}", "frac": frac, "ms": ms, "dram_tbps": x.nbytes / ms / 1e9,
                     "l2_tbps": (x.nbytes + hits) / ms / 1e9, "sm_mhz": sm_mhz()})
    print(f"{torch.cuda.get_device_name()}: X {x.nbytes / 1e9:.2f} GB, S {s.nbytes / 1e6:.1f} MB, "
          f"{programs} programs; bench copy ceiling {peaks['copy_tbps']:.2f} TB/s")
    print(f"{'what':26} {'ms':>8} {'DRAM TB/s':>10} {'L2 TB/s':>9} {'SM MHz':>7}")
    for r in rows:
        print(f"{r['what']:26} {r['ms']:8.4f} {r['dram_tbps']:10.2f} {r['l2_tbps']:9.2f} {r['sm_mhz'] or '-':>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
