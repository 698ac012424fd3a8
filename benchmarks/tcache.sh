#!/usr/bin/env bash
# Carry Triton's compile cache between device calls: a fresh machine compiles fla's autotuned kernels and ours
# again, ~60-90 s of a DeltaNet bench shape's 130-150 s (benchmarks/NOTES.md, sessions 43-44). Cache entries are
# keyed by Triton's version, the kernel's source and its options, so a changed kernel still compiles anew.
#   at the end of a device command:   bash benchmarks/tcache.sh save "$OUT"   -> $OUT/tcache.part-aa, -ab, ...
#                                     (15 MiB parts: a file returned from $OUT may be 16 MiB; ~23 MB in all)
#   here, after the call:             bash benchmarks/tcache.sh keep /work/.device/N   -> .tcache/ (add /.tcache/
#                                     to .git/info/exclude), then name ".tcache" in the next call's carry
#   at the start of a device command: bash benchmarks/tcache.sh load   (from the checkout's root) -> ~/.triton/cache
set -euo pipefail
cache_root=${TRITON_HOME:-$HOME}/.triton
case "${1:-}" in
  save)
    out=${2:?usage: $0 save OUT}
    [ -d "$cache_root/cache" ] || { echo "tcache: no $cache_root/cache to save" >&2; exit 0; }
    tar czf - -C "$cache_root" cache | split -b 15m - "$out/tcache.part-" ;;
  keep)
    src=${2:?usage: $0 keep DIR}
    mkdir -p .tcache
    rm -f .tcache/tcache.part-*
    cp "$src"/tcache.part-* .tcache/
    du -sh .tcache ;;
  load)
    if ls .tcache/tcache.part-* > /dev/null 2>&1; then
      mkdir -p "$cache_root"
      cat .tcache/tcache.part-* | tar xzf - -C "$cache_root"
      echo "tcache: $(ls "$cache_root/cache" | wc -l) cache entries loaded"
    else
      echo "tcache: nothing to load"
    fi ;;
  *)
    echo "usage: $0 save OUT | keep DIR | load" >&2
    exit 2 ;;
esac
