#!/usr/bin/env bash
# Snapshot HEAD for a device call: the device copies the whole working tree (work in progress
# included), so GPU runs start from .snap/tree.tar (git archive of HEAD) and .snap/.commit instead.
#   benchmarks/snapshot.sh      then carry [".snap", ".peers"] and run:
#   mkdir -p /tmp/tf && tar xf .snap/tree.tar -C /tmp/tf && cp .snap/.commit /tmp/tf/ && cp -r .peers /tmp/tf/ \
#     && cd /tmp/tf && bash benchmarks/gpu.sh STEPS...
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .snap
git archive --format=tar -o .snap/tree.tar HEAD
git rev-parse --short HEAD > .snap/.commit
echo "snapshot of $(cat .snap/.commit): $(du -h .snap/tree.tar | cut -f1)"
