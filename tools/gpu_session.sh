#!/usr/bin/env bash
# tinyvit's prepared GPU session: everything a GPU machine is needed for, as one command.
#
#   bash tools/gpu_session.sh [--budget SECONDS] [--only STEPS] [--dry-run]
#
# Run from the repository's root on a machine with an NVIDIA GPU, CuPy and (for the comparisons)
# PyTorch; nothing is installed (PYTHONPATH is the checkout). Results go to $OUT (default
# /tmp/tinyvit-gpu): summary.txt, passed.json (the kernels whose GPU tests passed here, to commit as
# tinyvit/kernels/cuda/passed.json) and logs.tgz (every log, the JUnit reports, the bench records).
#
# Steps (--only takes a comma-separated list of their names; default all, in this order):
#   env       versions; every kernel compiled and loaded (registers, shared memory)
#   record    the kernels' GPU tests, one process per file, CUDA_LAUNCH_BLOCKING=1, time limits
#             (python -m tinyvit.kernels.cuda.record), beside the rest of `pytest -m gpu`
#   sanitize  every kernel once under compute-sanitizer memcheck, racecheck and synccheck
#   kbench    ms per forward+backward of each kernel, its reference (CuPy ops) and PyTorch eager
#   bench     the training step against PyTorch eager (tinyvit bench --compare torch), fp32 and tf32
#   profile   where the fused step's time goes, op by op, host and GPU time (tools/step_profile.py)
#   train     a short real training run (Fashion-MNIST from .gpu-data/ if carried, else synthetic)
# Each step has its own time limit, cut to what is left of --budget (default 480 s), so a hang costs
# one step and the whole session ends inside the budget. --dry-run prints the commands and runs
# nothing (tests/test_gpu_session.py runs it on the CPU so that the script cannot rot).
# TINYVIT_COMMIT=<hash> names the commit in every record where the machine's .git is not the tree's
# (the device tool copies the working tree beside a stale .git): bash tools/gpu_session.sh with
# TINYVIT_COMMIT=$(git rev-parse HEAD) written into the command.
set -u
cd "$(dirname "$0")/.."
BUDGET=480
ONLY="env,record,sanitize,kbench,bench,profile,train"
DRY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        *) echo "gpu_session.sh: unknown argument $1 (--budget SECONDS, --only STEPS, --dry-run)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/tinyvit-gpu}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg
LOGS=$(mktemp -d)
mkdir -p "$OUT" "$LOGS/records"
START=$(date +%s)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

# wanted STEP: whether --only asks for it (and then its header, so that --dry-run lists every step)
wanted() { case ",$ONLY," in *",$1,"*) echo "=== step $1"; return 0 ;; *) return 1 ;; esac; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
note() { echo "$*" | tee -a "$SUMMARY"; }
pack() { [ "$DRY" = 1 ] || tar czf "$OUT/logs.tgz" --exclude="*.safetensors" -C "$LOGS" . 2>/dev/null; }

# run LOG LIMIT COMMAND...: the command under `timeout`, its limit cut to what the budget has left
# (skipped under 20 s), its output in $LOGS/LOG and on the terminal.
run() {
    local log=$1 limit=$2; shift 2
    local remaining; remaining=$(( $(left) - 10 ))
    [ "$remaining" -lt "$limit" ] && limit=$remaining
    if [ "$DRY" = 1 ]; then echo "[dry-run] ($log, ${limit}s) $*"; return 0; fi
    if [ "$limit" -lt 20 ]; then note "skipped (budget spent): $*"; return 0; fi
    echo "=== $(date +%T) [$log, ${limit}s] $*"
    timeout -k 5 "$limit" "$@" > "$LOGS/$log" 2>&1
    local code=$?
    cat "$LOGS/$log" | tail -40
    [ "$code" = 124 ] || [ "$code" = 137 ] && note "TIMED OUT after ${limit}s: $log"
    return $code
}

note "tinyvit GPU session $(date -u +%FT%TZ), commit ${TINYVIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)}, budget ${BUDGET}s"
[ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$SUMMARY"

if wanted env; then
    run env.txt 90 $PY tools/gpu_cases.py env
    [ "$DRY" = 1 ] || grep -E "^3\.|runs:|opt-in|compile \+ load" "$LOGS/env.txt" >> "$SUMMARY"
    pack
fi

if wanted record; then
    # The kernels' tests (which decide passed.json) and the rest of the GPU half of the suite at once:
    # separate processes, so a sticky CUDA error in one cannot fail the other.
    # pytest-xdist and pytest-timeout only where installed (an unknown option would fail the step)
    xdist=""; $PY -c "import xdist" 2>/dev/null && xdist="-n 6"
    per_test=""; $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout=120"
    others=$(ls tests/test_*.py | grep -v test_kernels_cuda_ | tr '\n' ' ')
    run pytest_gpu_others.txt 200 $PY -m pytest -q -m gpu -p no:cacheprovider $xdist $per_test \
        --junitxml="$LOGS/junit_others.xml" $others &
    others_pid=$!
    run record.txt 200 $PY -m tinyvit.kernels.cuda.record --output "$OUT/passed.json" --junit-dir "$LOGS/junit" \
        --jobs 5 --file-timeout 180 -- -q
    wait $others_pid
    if [ "$DRY" = 0 ]; then
        grep -E "^  test_kernels_cuda|CuPy [0-9]|timed out|killed" "$LOGS/record.txt" >> "$SUMMARY"
        note "rest of pytest -m gpu: $(grep -E '(passed|failed|error)' "$LOGS/pytest_gpu_others.txt" | tail -1)"
        grep -E "^(FAILED|ERROR) " "$LOGS/pytest_gpu_others.txt" | head -30 >> "$SUMMARY"
        # From here on the switchboard runs the kernels that passed here, as a user's run would.
        [ -f "$OUT/passed.json" ] && cp "$OUT/passed.json" tinyvit/kernels/cuda/passed.json
        note "passed here: $($PY -c "import json,sys; print(', '.join(json.load(open(sys.argv[1]))) or 'none')" "$OUT/passed.json" 2>&1)"
    fi
    pack
fi

if wanted sanitize; then
    # The three tools at once (separate processes); memcheck without CuPy's pool, so bounds are exact.
    run memcheck.txt 150 env TINYVIT_CUPY_NO_POOL=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        --print-limit 10 $PY tools/gpu_cases.py sanitize &
    a=$!
    run racecheck.txt 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
        --print-limit 10 $PY tools/gpu_cases.py sanitize &
    b=$!
    run synccheck.txt 150 compute-sanitizer --tool synccheck --error-exitcode 9 --print-limit 10 \
        $PY tools/gpu_cases.py sanitize &
    c=$!
    wait $a $b $c
    if [ "$DRY" = 0 ]; then
        for t in memcheck racecheck synccheck; do
            note "$t: $(grep -E 'ERROR SUMMARY|FAIL' "$LOGS/$t.txt" | head -3 | tr '\n' ' ')"
        done
    fi
    pack
fi

if wanted kbench; then
    run kbench.txt 90 $PY tools/gpu_cases.py bench
    [ "$DRY" = 1 ] || grep -E " ms" "$LOGS/kbench.txt" >> "$SUMMARY"
    pack
fi

if wanted bench; then
    # The issue's targets: vit-cifar/4 at batch 256 and ViT-S/16 at batch 64 no slower than PyTorch eager.
    # BENCH_SPECS: "model batch precision" triples separated by ';'.
    IFS=';' read -ra specs <<< "${BENCH_SPECS:-vit-cifar/4 256 fp32;vit-s/16 64 fp32;vit-cifar/4 256 tf32;vit-s/16 64 tf32;vit-b/16 64 fp32}"
    for spec in "${specs[@]}"; do
        set -- $spec
        name="bench-${1//\//-}-b$2-$3"
        run "$name.txt" 100 $PY -m tinyvit bench --model "$1" --batch-size "$2" --device cuda --precision "$3" \
            --kernels both --compare torch --warmup 3 --steps 10 --json "$LOGS/records/$name.json"
        [ "$DRY" = 1 ] || grep -E "images/s|ratio|slower|faster|peak|kernels" "$LOGS/$name.txt" | head -8 \
            | sed "s|^|$1 b$2 $3: |" >> "$SUMMARY"
        pack
    done
fi

if wanted profile; then
    # PROFILE_SPECS: "model batch" pairs separated by ';' (the fused step, float32).
    IFS=';' read -ra specs <<< "${PROFILE_SPECS:-vit-cifar/4 256;vit-s/16 64}"
    for spec in "${specs[@]}"; do
        set -- $spec
        name="profile-${1//\//-}-b$2"
        run "$name.txt" 60 $PY tools/step_profile.py --model "$1" --batch-size "$2" --device cuda --steps 5 \
            --json "$LOGS/records/$name.json"
        [ "$DRY" = 1 ] || head -14 "$LOGS/$name.txt" >> "$SUMMARY"
        pack
    done
fi

if wanted train; then
    data=(--dataset synthetic)
    [ -d .gpu-data/fashion-mnist ] && data=(--dataset fashion-mnist --data-dir .gpu-data)
    run train.txt 120 $PY -m tinyvit train "${data[@]}" --epochs 2 --device cuda --out "$LOGS/run"
    # progress bars rewrite their line with carriage returns: keep the epochs' own lines
    [ "$DRY" = 1 ] || tr '\r' '\n' < "$LOGS/train.txt" | grep -E "^(training|epoch [0-9]+/[0-9]+  |done|the recipe)" \
        | tail -6 >> "$SUMMARY"
    pack
fi

note "session took $(( $(date +%s) - START ))s"
pack
[ "$DRY" = 1 ] && rm -rf "$LOGS"
exit 0
