#!/usr/bin/env bash
# The ftmem demo: train a small GPT on 2 ranks, SIGKILL rank 1 right after step 12's snapshot,
# restart every rank from the SMP's memory, and check the final digest against a run without
# failure. Installs what it needs (torch 2.13 CPU, ftmem) first.
#
#   bash examples/demo.sh
#
# Until ftmem-launch lands, torchrun restarts the ranks and the SMP is started by hand here.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e . 2>&1 | grep -v -i "warning" || true

run=$(mktemp -d /tmp/ftmem-demo-XXXXXX)
python -m ftmem.smp --run-dir "$run" --run-id "demo$$" >"$run/smp.out" 2>"$run/smp.log" &
smp=$!
cleanup() { kill "$smp" 2>/dev/null && wait "$smp" 2>/dev/null; rm -rf "$run"; }
trap cleanup EXIT
for _ in $(seq 100); do grep -q READY "$run/smp.out" 2>/dev/null && break; sleep 0.1; done
grep -q READY "$run/smp.out" || { echo "SMP did not start:"; cat "$run/smp.log"; exit 1; }
echo "SMP ready (pid $smp), run dir $run"

export OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
args=(--steps 20 --d-model 128 --n-layers 2)

echo "== 1. reference run, no snapshots, no failure"
torchrun --standalone --nproc-per-node 2 examples/train_gpt.py "${args[@]}" --no-ftmem \
    2>&1 | tee "$run/ref.log" | grep -E "digest|final step"

echo "== 2. snapshot every step; rank 1 is SIGKILLed after step 12; torchrun restarts both ranks"
FTMEM_RUN_DIR="$run" torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
    examples/train_gpt.py "${args[@]}" --fail-at-step 12 --fail-rank 1 \
    2>&1 | tee "$run/ft.log" | grep -E "resumed from|digest|final step|exitcode|Signal" || true

ref=$(grep -o "digest [0-9a-f]*" "$run/ref.log" | sort -u)
got=$(grep -o "digest [0-9a-f]*" "$run/ft.log" | sort -u)
python -m ftmem.cli status --run-dir "$run"
if [[ -n "$ref" && "$ref" == "$got" ]]; then
    echo "== OK: the run that lost rank 1 ended bitwise equal to the reference ($ref)"
else
    echo "== MISMATCH: reference '$ref' vs recovered '$got'"; exit 1
fi
