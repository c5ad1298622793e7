#!/usr/bin/env bash
# The checks to run when a GPU machine is lent (one H100, its own PyTorch with CUDA, no package
# registry), and, beforehand here, the fetching of the wheels it lacks.
#
#   bash bench/device_check.sh --fetch     # here (network): wheels into .device-wheels/
#   bash bench/device_check.sh             # there: install offline, CUDA tests, GPU benchmarks
#   bash bench/device_check.sh --dry-run   # print the plan and check for CUDA; run nothing
#
# With the device tool: command `bash bench/device_check.sh`, timeout_s 540 (the script keeps
# to BUDGET_S, 450 s by default, whatever happens). Its files come back from $OUT; re-render
# the `gpu` section here with `python -m bench._render <files_at>/gpu.json`.
#
# On the device, in order (each step under `timeout`, all of them within BUDGET_S):
#   0. CUDA present? If not: says so and exits 2; nothing else runs.
#   1. install offline: pip install --no-deps --no-index --find-links WHEEL_DIR (what is already
#      installed at a version that fits is kept), then pip install --no-deps -e . (PYTHONPATH
#      holds the checkout as well).
#   2. bench/gpu_phases.py: the same state's save and restore taken apart phase by phase, with
#      the link's and page-locking's own figures (phases.json).
#   3. bench/datapath.py --gpu --quick: a >= 4 GiB CUDA state, stall, pinned D2H GB/s, D2H to
#      commit, restore (section `gpu`, written by the bench's own writer).
#   3b. every CUDA test: the test files that skip without CUDA (found by grep), JUnit XML.
#   4. dcp.async_save with pinned staging (DefaultStager) on the same CUDA state: blocking,
#      until staged, until written, D2H GB/s. datapath.py --gpu has no DCP baseline (its
#      baseline is the bare pinned copy), so this step runs bench/_baselines.dcp_async_saves.
# Outputs, in $OUT if set, else ./device-out (at most 8 files come back from the device):
#   device-check.log (everything), summary.txt (one line a step), phases.json, cuda-tests.xml, gpu.json,
#   dcp-pinned.json, benchmarks.md (docs/benchmarks.md with the `gpu` section updated).
# Exit status: 0 every step passed; 1 a step failed or ran out of time; 2 no CUDA; 3 usage, or
# no wheels where the device install expects them.

set -uo pipefail

# The device's Python (major.minor) for --fetch: the lent machines' python3 is 3.12 (their
# image's PyTorch venv); this machine's python3 may differ. Override: DEVICE_PY_VERSION=3.11.
PY_VERSION="${DEVICE_PY_VERSION:-3.12}"
# manylinux tags pip accepts for those wheels (pip matches each exactly; the device's PyTorch
# wheels need glibc >= 2.28, so 2_28 wheels run there too).
PLATFORMS=(manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64)
PYTHON="${PYTHON:-python3}"                      # on the device: the one that holds PyTorch
BUDGET_S="${DEVICE_CHECK_BUDGET_S:-450}"         # the whole device part, seconds (< 8 min)
GPU_ARGS="${GPU_ARGS:---quick}"                  # datapath.py --gpu profile: 4 GiB, 5 saves
DCP_GIB="${DCP_GIB:-4}"                          # step 4's state
DCP_SAVES="${DCP_SAVES:-3}"                      # step 4's timed saves (after one warm-up)

cd "$(dirname "$0")/.." || exit 3
ROOT="$PWD"
if [ -n "${WHEEL_DIR:-}" ]; then
    :
elif [ -d shared ]; then
    WHEEL_DIR=shared/wheels
else
    WHEEL_DIR=.device-wheels
fi
OUT_DIR="${OUT:-$ROOT/device-out}"

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

# ---------------------------------------------------------------------------- --fetch (here)

# The runtime dependencies but torch (pyproject.toml), pytest and pytest-timeout (its `test`
# extra), and what `pip install -e .` builds with (its build-system), one a line.
requirements() {
    python3 - <<'EOF'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    doc = tomllib.load(f)


def name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()


reqs = [r for r in doc["project"]["dependencies"] if name(r) != "torch"]
reqs += [r for r in doc["project"]["optional-dependencies"]["test"]
         if name(r) in ("pytest", "pytest-timeout")]
reqs += doc["build-system"]["requires"] + ["wheel"]
print("\n".join(reqs))
EOF
}

fetch() {
    local reqs platform_flags=() p
    mapfile -t reqs < <(requirements) || return 1
    [ "${#reqs[@]}" -gt 0 ] || { echo "no requirements read from pyproject.toml" >&2; return 1; }
    for p in "${PLATFORMS[@]}"; do
        platform_flags+=(--platform "$p")
    done
    mkdir -p "$WHEEL_DIR"
    echo "downloading wheels for CPython $PY_VERSION into $WHEEL_DIR: ${reqs[*]}"
    python3 -m pip download --disable-pip-version-check --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp "${platform_flags[@]}" \
        -d "$WHEEL_DIR" "${reqs[@]}" || return 1
    # What the device installs: the direct requirements with their versions, then every other
    # wheel fetched (their dependencies) by name; --no-deps there, so all are listed.
    python3 - "$WHEEL_DIR" "${reqs[@]}" <<'EOF' || return 1
import pathlib
import re
import sys

wheel_dir, direct = pathlib.Path(sys.argv[1]), sys.argv[2:]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


named = {norm(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in direct}
fetched = sorted({norm(w.name.split("-")[0]) for w in wheel_dir.glob("*.whl")})
lines = direct + [n for n in fetched if n not in named]
(wheel_dir / "requirements.txt").write_text("\n".join(lines) + "\n")
missing = sorted(named - set(fetched))
if missing:
    sys.exit(f"no wheel fetched for {missing}")
EOF
    echo "$PY_VERSION" >"$WHEEL_DIR/python-version"
    echo "wheels in $WHEEL_DIR ($(du -sh "$WHEEL_DIR" | cut -f1)):"
    ls -1 "$WHEEL_DIR"
    echo "they travel to the device with the working tree: untracked files git does not ignore"
    echo "(or shared/); a WHEEL_DIR that git ignores must be named in the device tool's carry"
}

# ------------------------------------------------------------------------ the device part

FAILED=0
SUMMARY=""

left() {
    echo $((BUDGET_S - SECONDS))
}

note() {
    SUMMARY+="$1"$'\n'
    echo "== $1"
}

# run_step NAME CAP_S STEP: this script's function STEP in a process of its own (`--_step`)
# under `timeout` (at most CAP_S, and what the budget leaves minus 15 s); its status noted; a
# failure or a timeout fails the script at the end.
run_step() {
    local name="$1" cap="$2" step="$3" budget t t0 rc
    budget=$(left)
    t=$((budget - 15 < cap ? budget - 15 : cap))
    if [ "$t" -lt 30 ]; then
        note "$name: NOT RUN (${budget}s of the ${BUDGET_S}s budget left)"
        FAILED=1
        return 1
    fi
    echo "== $name (timeout ${t}s)"
    t0=$SECONDS
    timeout -k 15 "$t" bash "$0" --_step "$step"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        note "$name: ok ($((SECONDS - t0))s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note "$name: TIMED OUT after ${t}s"
        FAILED=1
    else
        note "$name: FAILED with status $rc ($((SECONDS - t0))s)"
        FAILED=1
    fi
    return "$rc"
}

cuda_check() {
    "$PYTHON" - <<'EOF'
import sys

try:
    import torch
except ImportError as exc:
    print(f"NO CUDA: torch does not import ({exc})")
    sys.exit(2)
build = torch.version.cuda
if not torch.cuda.is_available():
    print(f"NO CUDA: torch {torch.__version__} (CUDA build: {build}) sees no CUDA device")
    sys.exit(2)
props = torch.cuda.get_device_properties(0)
print(f"CUDA: torch {torch.__version__} (CUDA {build}), {torch.cuda.device_count()} device(s), "
      f"{torch.cuda.get_device_name(0)} with {props.total_memory / 2**30:.0f} GiB")
EOF
}

install() {
    local want have
    if [ ! -f "$WHEEL_DIR/requirements.txt" ]; then
        echo "no $WHEEL_DIR/requirements.txt: run 'bash bench/device_check.sh --fetch' here first"
        return 3
    fi
    want=$(cat "$WHEEL_DIR/python-version" 2>/dev/null || echo "?")
    have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$want" != "$have" ]; then
        echo "WARNING: the wheels are for Python $want, this is $have: compiled ones will not"
        echo "install (rerun --fetch with DEVICE_PY_VERSION=$have); installed packages may do"
    fi
    "$PYTHON" -m pip install --disable-pip-version-check --no-deps --no-index \
        --find-links "$WHEEL_DIR" -r "$WHEEL_DIR/requirements.txt" || return 1
    "$PYTHON" -m pip install --disable-pip-version-check --no-deps --no-index \
        --find-links "$WHEEL_DIR" -e . || return 1
    "$PYTHON" -c 'import ftmem, zmq, pyeclib, psutil, xxhash, blake3, pytest; print("imports ok:", ftmem.__file__)'
}

cuda_tests() {
    local files
    mapfile -t files < <(grep -rlE 'torch\.cuda\.is_available\(\)|pytest\.mark\.cuda|needs a CUDA' \
        tests --include='test_*.py' | sort)
    if [ "${#files[@]}" -eq 0 ]; then
        echo "no CUDA test found under tests/"
        return 1
    fi
    echo "CUDA test files: ${files[*]}"
    "$PYTHON" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT_DIR/cuda-tests.xml" \
        "${files[@]}" || return 1
    # Passing because every test skipped would be no check at all.
    "$PYTHON" - "$OUT_DIR/cuda-tests.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
print(f"CUDA tests: {tests} collected, {skipped} skipped, {tests - skipped} ran")
sys.exit(0 if tests > skipped else 1)
EOF
}

phases() {
    "$PYTHON" bench/gpu_phases.py --gib "$DCP_GIB" --json "$OUT_DIR/phases.json"
}

gpu_bench() {
    # The bench's own writer updates docs/benchmarks.md; a copy of it goes to $OUT.
    # shellcheck disable=SC2086 # GPU_ARGS holds several flags
    "$PYTHON" bench/datapath.py --gpu $GPU_ARGS --json "$OUT_DIR/gpu.json" \
        --out docs/benchmarks.md
    local rc=$?
    cp docs/benchmarks.md "$OUT_DIR/benchmarks.md"
    return "$rc"
}

dcp_pinned() {
    DCP_GIB="$DCP_GIB" DCP_SAVES="$DCP_SAVES" "$PYTHON" - "$OUT_DIR/dcp-pinned.json" <<'EOF'
"""dcp.async_save of a CUDA state with pinned, asynchronous staging (one reused DefaultStager),
to a temporary directory: blocking, until staged, until written, and the D2H GB/s of staging."""
import json
import os
import shutil
import statistics
import sys
import tempfile

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.getcwd())
from bench import _baselines as baselines  # noqa: E402
from bench.datapath import build_cuda_state  # noqa: E402

size, saves = float(os.environ["DCP_GIB"]), int(os.environ["DCP_SAVES"])
model, optimizer, layers = build_cuda_state(size)
# One flat dict of the same tensors: DefaultStager's deepcopy rebuilds any other object
# through __reduce_ex__, whose class argument it has no rule for (KeyError: <class 'type'>
# on torch 2.11, with the model's OrderedDict and with nested plain dicts alike).
sd = {f"model.{k}": v for k, v in model.state_dict().items()}
for pid, st in optimizer.state_dict()["state"].items():
    sd.update({f"optim.{pid}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
tensors = baselines.state_tensors(sd)
cuda = sum(t.nbytes for t in tensors if t.is_cuda)
options = StagingOptions(
    use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
    use_non_blocking_copy=True,
)
stager = DefaultStager(options)
# torch 2.11's DefaultStager closes its StateDictStager after every stage, so a reused one fails
# its second save with KeyError: <class 'type'> (pytorch/pytorch#183413, fixed by #183424 for
# later releases): keep its staging buffers across saves, as those releases do.
inner = getattr(stager, "_state_dict_stager", None)
if inner is not None:
    inner.close = lambda: None
disk = tempfile.mkdtemp(prefix="ftmem-dcp-pinned-")
try:
    r = baselines.dcp_async_saves(sd, disk, saves, stager)
finally:
    stager.close()
    shutil.rmtree(disk, ignore_errors=True)
r.update(size_gib=size, layers=layers, cuda_bytes=cuda, tensors=len(tensors), options=repr(options))
r["device"] = torch.cuda.get_device_name()
r["d2h_gbps"] = [cuda / s / 1e9 for s in r["staged"]]
with open(sys.argv[1], "w") as f:
    json.dump(r, f, indent=1)
med = statistics.median
print(f"dcp.async_save, pinned async staging, {layers} + AdamW, {cuda / 2**30:.2f} GiB on the GPU:")
for key in ("blocking", "staged", "done"):
    print(f"  {key:9s} median {med(r[key]):.3f} s  (min {min(r[key]):.3f}, max {max(r[key]):.3f})")
print(f"  D2H while staging: median {med(r['d2h_gbps']):.1f} GB/s; first call {r['first']}")
EOF
}

plan() {
    echo "device part, in $ROOT, budget ${BUDGET_S}s, outputs in $OUT_DIR:"
    echo "  0. CUDA check with $PYTHON"
    echo "  1. $PYTHON -m pip install --no-deps --no-index --find-links $WHEEL_DIR -r $WHEEL_DIR/requirements.txt; ... -e ."
    local wheels=("$WHEEL_DIR"/*.whl)
    [ -e "${wheels[0]}" ] || wheels=()
    echo "     wheels: ${#wheels[@]} in $WHEEL_DIR, for Python $(cat "$WHEEL_DIR/python-version" 2>/dev/null || echo '? (not fetched)')"
    echo "  2. $PYTHON -m pytest -q -rs $(grep -rlE 'torch\.cuda\.is_available\(\)|pytest\.mark\.cuda|needs a CUDA' tests --include='test_*.py' | sort | tr '\n' ' ')"
    echo "  3. $PYTHON bench/datapath.py --gpu $GPU_ARGS --json $OUT_DIR/gpu.json --out docs/benchmarks.md"
    echo "  4. dcp.async_save with pinned staging, ${DCP_GIB} GiB CUDA state, $DCP_SAVES saves"
}

device() {
    local dry="$1" rc
    mkdir -p "$OUT_DIR" || exit 3
    exec > >(tee -a "$OUT_DIR/device-check.log") 2>&1
    echo "device_check.sh on $(hostname) at $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores"
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    [ "$dry" = 1 ] && plan
    cuda_check
    rc=$?
    if [ "$rc" -ne 0 ]; then
        note "CUDA check: NO CUDA (status $rc): nothing was installed, tested or measured"
        printf '%s' "$SUMMARY" >"$OUT_DIR/summary.txt"
        exit 2
    fi
    note "CUDA check: ok"
    if [ "$dry" = 1 ]; then
        echo "dry run: nothing else runs"
        exit 0
    fi
    run_step "install (offline wheels, pip install -e .)" 150 install
    if [ $? -eq 3 ]; then
        printf '%s' "$SUMMARY" >"$OUT_DIR/summary.txt"
        exit 3
    fi
    run_step "bench/gpu_phases.py (where a save's and a restore's time goes)" 150 phases
    run_step "bench/datapath.py --gpu $GPU_ARGS" 240 gpu_bench
    run_step "CUDA tests" 180 cuda_tests
    run_step "dcp.async_save, pinned staging, ${DCP_GIB} GiB" 120 dcp_pinned
    echo
    echo "summary (${SECONDS}s of the ${BUDGET_S}s budget):"
    printf '%s' "$SUMMARY" | tee "$OUT_DIR/summary.txt"
    exit "$FAILED"
}

case "${1:-}" in
    --fetch) fetch || exit 1 ;;
    --dry-run) device 1 ;;
    --_step)
        case "${2:-}" in
            install | phases | cuda_tests | gpu_bench | dcp_pinned) "$2" ;;
            *) exit 3 ;;
        esac
        ;;
    "") device 0 ;;
    -h | --help) usage ;;
    *)
        usage >&2
        exit 3
        ;;
esac
