#!/usr/bin/env bash
# The one script every GPU session runs, from the repository root on the device machine:
#   environment -> tests/gpu -> benchmarks (random:llama-8b, random:llama-1b; async and sync).
#
# Writes into $OUT (at most 8 files come back): env.log, gpu_tests.log, bench.log,
# bench_llama8b.json, bench_llama1b.json, summary.log. Designed to finish in under 9 minutes:
# every step has its own timeout (exit code 124 in the summary means it ran out of time).
#
# Knobs (environment):
#   BENCH_SCALE=1          divides every benchmark output length (2, 4, ... when time is short)
#   BENCH_OUTPUT_LEN=1024  output tokens per request before scaling
#   BENCH_1B_REQUESTS=256  requests in the llama-1b benchmark
#   BENCH_EXTRA=           more scripts/bench.py flags for both benchmarks (word-split; later
#                          flags win, e.g. "--launch-arg=--block-size=32")
#   BENCH_MODES=async,sync modes each benchmark runs (scripts/bench.py --modes)
#   PYTEST_K=              a pytest -k expression to run part of tests/gpu
#   TEST_TIMEOUT=180       seconds for pytest tests/gpu
#   BENCH_TIMEOUT=140      seconds for each benchmark (both modes)
#   PYTHON=python
set -uo pipefail

OUT=${OUT:-out}  # the device tool sets it; `make gpu-check` writes to ./out
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/bench.py imports cbpipe
PY=${PYTHON:-python}
BENCH_SCALE=${BENCH_SCALE:-1}
BENCH_OUTPUT_LEN=${BENCH_OUTPUT_LEN:-1024}
BENCH_1B_REQUESTS=${BENCH_1B_REQUESTS:-256}
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
BENCH_MODES=${BENCH_MODES:-async,sync}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-140}
read -r -a bench_extra <<<"${BENCH_EXTRA:-}"
output_len=$((BENCH_OUTPUT_LEN / BENCH_SCALE))
mkdir -p "$OUT"
started=$SECONDS

section() { printf '\n===== %s (t=%ds) =====\n' "$*" $((SECONDS - started)); }

environment() {
    section environment
    nvidia-smi
    "$PY" - <<'EOF'
import platform, sys
import torch, transformers
print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})"
      f"  transformers {transformers.__version__}")
print("cuda available:", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for name in ("zmq", "msgpack", "numpy", "pytest"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except ImportError:
        print(f"{name} MISSING")
EOF
    if [ -f COMMIT ]; then
        echo "commit $(cat COMMIT) (from COMMIT)"
    elif git rev-parse --verify -q HEAD >/dev/null 2>&1; then
        echo "commit $(git rev-parse HEAD)"
        git status --short | head -20
    else
        echo "commit unknown (no .git, no COMMIT file)"
    fi
}

bench() {  # bench NAME ARGS...: both modes, JSON to $OUT/bench_NAME.json
    local name=$1
    shift
    section "bench $name"
    timeout -k 30 "$BENCH_TIMEOUT" "$PY" scripts/bench.py "$@" --modes "$BENCH_MODES" \
        ${bench_extra[@]+"${bench_extra[@]}"} --json "$OUT/bench_$name.json"
}

environment 2>&1 | tee "$OUT/env.log"
if ! "$PY" -c 'import zmq, msgpack' 2>/dev/null; then
    echo "pyzmq or msgpack is missing: install them first" | tee -a "$OUT/env.log"
    exit 2
fi

section tests
timeout -k 30 "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu -m gpu -v -s ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

{
    bench llama8b --model random:llama-8b --num-requests 32 --prompt-len 128 \
        --output-len "$output_len"
    echo "exit code $?"
    bench llama1b --model random:llama-1b --num-requests "$BENCH_1B_REQUESTS" \
        --prompt-len 128 --output-len "$output_len"
    echo "exit code $?"
} 2>&1 | tee "$OUT/bench.log"
bench_rcs=$(grep '^exit code' "$OUT/bench.log" | awk '{print $3}' | paste -sd, -)

{
    section summary
    echo "tests: exit code $tests_rc; benchmarks (8b,1b): exit codes $bench_rcs (124: timed out)"
    echo "BENCH_SCALE=$BENCH_SCALE output_len=$output_len; total $((SECONDS - started)) s"
    grep -h -A 10 '^model ' "$OUT/bench.log" || true
    echo "engine processes left: $(pgrep -f 'cbpipe.launcher' | paste -sd' ' - || true)"
} 2>&1 | tee "$OUT/summary.log"
[ "$tests_rc" = 0 ] && [ "$bench_rcs" = "0,0" ]
