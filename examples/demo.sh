#!/usr/bin/env bash
# The ftmem demo: train a small GPT (the checkout's test workload,
# tests/_support/workload/train.py: examples/train_gpt.py's loop plus a failure switch) on 2
# ranks under ftmem-launch with a snapshot every step, SIGKILL rank 1 right after step 12's
# snapshot, let ftmem-launch restart every rank from the SMP's memory, and check the final
# digest against a run without failure. It runs from the checkout (the workload is not part of
# the ftmem package). Installs what it needs (torch 2.13 CPU build, ftmem) first.
#
#   bash examples/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e . 2>&1 | grep -v -i "warning" || true

work=$(mktemp -d /tmp/ftmem-demo-XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
script=(tests/_support/workload/train.py --steps 20 --d-model 128 --n-layers 2)

echo "== 1. reference run: no snapshots, no failure"
ftmem-launch --standalone --nproc-per-node 2 "${script[@]}" --no-ftmem \
    >"$work/ref.log" 2>&1
grep -E "digest" "$work/ref.log"

echo "== 2. snapshot every step; rank 1 SIGKILLs itself after step 12; ftmem-launch restarts both"
ftmem-launch --standalone --nproc-per-node 2 --ftmem-run-dir "$work/run" \
    "${script[@]}" --fail-at-step 12 --fail-rank 1 >"$work/ft.log" 2>&1 || {
    tail -40 "$work/ft.log"; exit 1; }
grep -E "injecting|FAILED|RESUMED|resumed from step [1-9]|digest" "$work/ft.log" | cut -c1-200

ref=$(grep -o "digest [0-9a-f]*" "$work/ref.log" | sort -u)
got=$(grep -o "digest [0-9a-f]*" "$work/ft.log" | sort -u)
if [[ -n "$ref" && "$ref" == "$got" ]]; then
    echo "== OK: the run that lost rank 1 ended bitwise equal to the reference ($ref)"
else
    echo "== MISMATCH: reference '$ref' vs recovered '$got'"; exit 1
fi
