#!/usr/bin/env bash
# The one script every GPU session runs, from the repository root on the device machine.
# Parts (PARTS, a comma list, in this order):
#   tests    pytest tests/gpu and the kernel tests on the GPU: more than one call holds, since
#            the launched engines compile by default; split it by files with TEST_PATHS:
#            "tests/gpu/test_architectures_gpu.py tests/gpu/test_gpu.py" (376 s at 603fbaa,
#            the two engine fixtures 73-76 s each), "tests/gpu/test_worker_step.py
#            tests/gpu/test_full_sampling.py" (142 s at 77aa80f), then "kernels" (about
#            150 s: with test_full_sampling.py 221 s at b024db1)
#            (PYTEST_K="test_gpu" matches the kernel tests' test_gpu_* cases too) (~15 min)
#   micro    scripts/bench_attention.py, scripts/bench_matmul.py, one decode step of random:llama-8b at batch 32
#            (context 4096) eager vs CUDA graph against its bandwidth floor, and one mixed
#            step of random:llama-1b (decodes + prefill chunks), profiled          (~3 min)
#   gemm     scripts/bench_matmul.py --only-candidate: the tiled split-K Triton candidate swept
#            against cuBLAS and cuBLASLt for q|k|v, o and down of GEMM_MODEL at GEMM_BATCH rows
#            (random:llama-1b at 256: the products bound by arithmetic there)     (~4 min)
#   chain    scripts/bench_layer_chain.py: a decode layer's kernels at CHAIN_ROWS rows of
#            CHAIN_MODEL (random:llama-8b x32), CHAIN_LAYERS (32) layers from a CUDA graph:
#            the engine's chain (cuBLASLt's products, inductor-like small kernels) against
#            Triton products with the norms and residual adds fused in, each chain's kernels
#            from the profiler; with CHAIN_CONTEXT>0 attention too (every sequence at that
#            many tokens), and the batch in two halves, in turn and on two streams;
#            CHAIN_FLAGS more flags, word-split (--cache-layouts: with CHAIN_CONTEXT, the
#            engine's chain over three layouts of the KV cache instead)          (~1 min)
#   step     one decode step of random:llama-8b at batch 32 (context 4096) from a CUDA graph,
#            with and without --fuse-projections                                 (~1 min)
#   layout   the step part's graph step with each sequence's KV blocks together, then laid
#            out as a server's lockstep batch has them (--engine-block-layout)   (~2 min)
#   step1b   the 1B x256 decode step: the attention kernel at head_dim 64 (batch 256, context
#            640, the bench part's mean) against gather+SDPA with a sweep of its settings (heads
#            per program among them), the 8B's head_dim 128 without one, then the decode
#            steps of STEP1B_PROFILES (the 1B x256 at context 640), compiled, profiled (~5 min)
#   mixed    mixed steps (decodes beside prefill chunks, as a server under arrivals runs them)
#            of random:MIXED_MODEL at context MIXED_CONTEXT, one per MIXED_MAKEUPS entry
#            (DECODES:CHUNK:CHUNKS), eager layers, compiled ones, and compiled from the mixed
#            graphs: wall, the kernels' device time from the profiler, the top operators (~4-6 min)
#   imports  what the launcher's imports cost on this host: whether Python may write bytecode
#            and the libraries ship it; `python -X importtime` of cbpipe.launcher, its 12
#            slowest modules (cumulative), twice, then twice with PYTHONPYCACHEPREFIX set to
#            a writable folder                                                   (~1-2 min)
#   hostcpu  the host's CPU against the scheduler's: lscpu, then scripts/bench_scheduler.py at the
#            1B bench's shape (256 sequences, 128 + 1024 tokens) HOSTCPU_RUNS times: the
#            scheduler's CPU a step on this host without a GPU, to set beside the bench part's
#            "sched. CPU ms/step" (wall time in the engine; its trace is in traces1b_256) (~1 min);
#            then with HOSTCPU_INTERVALS ("1 3") ms of sleep between steps, as the engine's
#            scheduler waits for the device between bursts (a step's data goes cold meanwhile);
#            HOSTCPU_STRUCTURED="0.25 1.0" also runs it with those fractions of the requests
#            under a JSON schema (structured output), on a BPE of 128000 tokens trained on the
#            host's Python sources (+1-3 min); HOSTCPU_SEQS=1024 runs the plain and
#            interval runs with 1,024 sequences and 8,192 tokens a step (a large GPU's defaults)
#   bench    random:llama-8b x32 and random:llama-1b x256, 128 prompt + BENCH_OUTPUT_LEN new
#            tokens, async and sync, with the default flags (the decode forward compiled:
#            a cold compile cache adds 1-2 minutes to the first start-up of each model; each
#            mode starts its own engine, so the second reads the cache the first wrote; with
#            BENCH_EXTRA=--launch-arg=--log-level=info each engine's start-up breakdown is
#            printed)                                                            (~3-6 min)
#   ramp     the bench part's random:llama-1b x256 run, async, with the worker's step profiler
#            (CBPIPE_PROFILE_STEPS) over RAMP_STEPS (8-20: the ramp's prefill and mixed steps,
#            then decode steps from graphs; the warm-up request takes the first steps): each
#            step's launch summarised by scripts/profile_summary.py in ramp_profile.txt (host
#            time, its kernels' device time, the Python calls and operators under it), the
#            packed trace in ramp_profile/, the step trace in traces_ramp      (~2 min)
#   startup  warm start-ups of STARTUP_MODEL: one launch to warm the compile cache, then
#            STARTUP_REPEATS rounds that launch once with each of STARTUP_VARIANTS (launch
#            arguments, ";" between variants, an empty one the defaults), each serving 4 short
#            requests: the ready time and the worker's start-up breakdown of each  (~2-4 min)
#   target   issue 3's runs: random:llama-8b x32, 256 prompt + 8192 new tokens, async and
#            sync; random:llama-1b x1024, prompts 64-1024 and outputs 64-512, async
#            (TARGET_1B_MODES)                                                    (~6 min)
#   compile  the micro part's 8B decode step with --compile-decode: start-up and step time
#   truncation  top-k/top-p alone: scripts/bench_truncation.py (the Triton kernel against the
#            stable sort it replaced, peaked and flat rows at TRUNCATION_ROWS, then the
#            compiled samplers: the full one through its kernels, with top-p by the sort and
#            as its torch reference, the temperature-only one through the kernels and as its
#            reference; TRUNCATION_LAUNCH=2048x8,8192x16 first sweeps the kernel's pass width
#            and warps), then the GPU tests of the sampler and its kernels           (~4 min)
#            (TRUNCATION_KERNELS=1: the compiled full sampler's kernels too, profiled)
#   sampling the decode step per sampling preset (greedy, plain temperature, the full sampler
#            with top-k/top-p/min_p without and with the top 20 alternatives, penalties,
#            greedy with 5 alternatives) from CUDA graphs: random:llama-8b x32 (context 4096)
#            and random:llama-1b x256 (context 512), every bucket up to the batch captured as
#            the worker does (capture time and memory, then the same without the full
#            sampler's graphs, where FULL steps run eagerly); then the full sampler's GPU
#            tests. SAMPLING_COMPILE=1 adds the 8B presets with --compile-decode  (~6 min)
#   models   the architecture matrix (scripts/check_architectures.py: every served architecture
#            of tests/architectures.py against generate, in ARCH_DTYPES, how many match
#            exactly), then the GPU cases of the attention kernel tests (sliding windows,
#            soft-cap, sinks among them) and tests/gpu/test_architectures_gpu.py (variant
#            models through graphs, compile and the warm-up)                       (~6-9 min)
#   gemma2   one decode step of random:gemma2-2b x32 at context 8192 (window 4096 on half
#            the layers) eager, from a CUDA graph and compiled, against its floor     (~5 min)
#   serving  scripts/bench_serving.py: random:llama-1b, 256 concurrent streams of 128 prompt +
#            BENCH_OUTPUT_LEN tokens through HTTP (SERVING_1B_SERVERS server processes, each
#            count its own engine) and through ZeroMQ; random:llama-8b over HTTP at Poisson
#            arrival rates SERVING_8B_RATES, time to first token and inter-token latency
#            p50/p90/p99 (needs the HTTP wheels: README)                         (~7 min);
#            SERVING_RUNS=arrivals: launch variants in turn under Poisson arrivals (ARRIVALS_*)
#   prefix   prefix caching on and off: random:llama-8b, 512 requests sharing a 2000-token
#            system prompt plus 50-150 tokens of their own, 128 new tokens (PREFIX_REQUESTS),
#            async; random:llama-1b, 64 conversations of 8 turns (each re-sends its history
#            plus 100 new tokens, 128 new tokens a turn): time to first token per turn (~5 min)
#   tp       tensor parallelism, on a machine of two GPUs (nvidia-h200-x2): the bfloat16
#            comparison of --tensor-parallel-size 2 against 1 on a checkpoint of
#            random:llama-8b's weights (tests/gpu/test_tensor_parallel_gpu.py: how many of 32
#            requests match exactly, graphs and compiled); random:llama-8b x32, 128 prompt +
#            BENCH_OUTPUT_LEN new tokens at TP=1 and TP=2 (throughput, decode step p50: the
#            goal is TP=2 at most 0.6x TP=1), and x1 (time per output token at batch 1);
#            random:llama-70b x32 at TP=2 (its floor is bench's printed floor halved: each GPU
#            reads half the weights). TP_RUNS=compare,llama8b,batch1,llama70b   (~10-15 min)
#            Mixed-step graphs are off at TP>1 until `compare` has run with them (lift the
#            gate in cbpipe/worker/process.py's _load for that run)
# One device call runs at most 10 minutes: split the parts over calls (PARTS=tests,micro, then
# PARTS=bench, then PARTS=target). Writes logs and JSON into $OUT; summary.log last. A call
# returns at most eight files from the device tool's $OUT, and a bench part alone writes more
# (traces, JSON, clocks): for several parts in one call, give each its own OUT outside it and
# send each run's stdout (every part's log, tee'd) into the tool's $OUT, with any trace the
# analysis needs copied beside it.
#
# Knobs (environment):
#   PARTS=tests,micro,bench  parts to run
#   STEP1B_SWEEP64=256x640 BATCHxCONTEXT cases of step1b's head_dim 64 sweep (empty: none)
#   STEP1B_SWEEP128=       BATCHxCONTEXT cases (comma list) of a head_dim 128 sweep in step1b
#   STEP1B_PROFILES=llama-1b:256:640  MODEL:BATCH:CONTEXT[:FLAGS] steps (comma list) that
#                          step1b profiles compiled, after its attention runs (empty: none);
#                          FLAGS go to profile_step.py, word-split (llama-8b:32:640:--inductor
#                          combo_kernels=True)
#   MIXED_MODEL=llama-1b MIXED_CONTEXT=640 MIXED_MAKEUPS=253:127:3,64:512:4  the mixed part's
#                          steps; MIXED_MODES="--no-compile-decode;--compile-decode;--compile-decode
#                          --mixed-graph-tokens=2176" its runs (";" between them): eager layers,
#                          compiled ones, and compiled replayed from the mixed graphs (a mode
#                          replays them only with --mixed-graph-tokens: profile_step.py's 0,
#                          not the engine's 1024, is the default there)
#   GEMM_MODEL=random:llama-1b GEMM_BATCH=256  the gemm part's shapes and rows (word-split
#                          batches: "128 256"); GEMM_TIMEOUT=300 seconds for its sweep
#   STEP1B_ATTENTION=1     0: step1b without its attention kernel runs
#   BENCH_SCALE=1          divides every benchmark output length (2, 4, ... when time is short)
#   BENCH_OUTPUT_LEN=1024  output tokens per request in the bench part, before scaling
#   BENCH_1B_REQUESTS=256  requests in the bench part's llama-1b run
#   BENCH_EXTRA=           more scripts/bench.py flags for every benchmark (word-split; later
#                          flags win, e.g. "--launch-arg=--no-cuda-graphs")
#   BENCH_MODES=async,sync modes each benchmark runs (scripts/bench.py --modes);
#                          BENCH_1B_MODES overrides it for the bench part's llama-1b run
#   BENCH_MODELS=llama8b,llama1b  the bench part's runs
#   BENCH_1B_TOKENIZER=    N: the llama-1b run once more with a byte-level BPE of N tokens
#                          trained on the host's Python sources (128256, Llama 3's size; about
#                          a minute the first time) as --tokenizer, so the scheduler's text
#                          stage runs, which the presets, without a tokenizer, never do;
#                          then a third time with the client making the text instead
#   STARTUP_MODEL=random:llama-8b   STARTUP_REPEATS=2
#   STARTUP_WARMING=1       0: no warming launch first (the compile cache already warm); it
#                          runs from this tree alone (the trees share the compile cache)
#   STARTUP_CHECKPOINT=     a preset (random:llama-8b): its weights saved once as a checkpoint
#                          folder in /tmp (scripts/save_checkpoint.py, about 30 s for the 8B),
#                          which the startup part launches instead of STARTUP_MODEL, reading
#                          the weights from disk as a user's model; STARTUP_EVICT=1 drops its
#                          files from the page cache before every launch (a first start after
#                          a download)
#   STARTUP_VARIANTS=";--no-saved-traces"  the startup part's launch arguments, alternated
#   STARTUP_BASELINE=      a folder holding another commit's tree (its cbpipe/ and scripts/,
#                          e.g. `git archive COMMIT cbpipe scripts | tar x -C .whl/base`, carried):
#                          every launch runs from it too, beside this tree's on the same host
#                          (NAME_base; this tree first in odd rounds, the base first in even
#                          ones, so that neither always follows the other); run from its own
#                          folder, as `python -m` puts the working folder first on sys.path
#   TARGET_RUNS=llama8b,llama1b   the target part's runs
#   SERVING_RUNS=llama1b,llama8b  the serving part's runs
#   SERVING_1B_SERVERS="1 4"      HTTP server processes (--api-server-count) of each 1b run
#   SERVING_8B_RATES=2,8,32       requests per second of the 8B runs (32 saturates it)
#   SERVING_8B_PROMPTS=128        requests at each rate
#   SERVING_8B_SERVERS=2          HTTP server processes of the 8B run
#   SERVING_TIMEOUT=300           seconds for each serving run (start-up included)
#   SERVING_RUNS=...,arrivals     also served under Poisson arrivals through ZeroMQ, launch
#                          variants in turn, as session 36 compared the mixed graphs:
#   ARRIVALS_MODELS="llama-1b:64 llama-8b:16"  MODEL:RATE (requests a second) runs
#   ARRIVALS_LENS=256:256 ARRIVALS_PROMPTS=320 ARRIVALS_ROUNDS=2  prompt:output tokens,
#                          requests a run, rounds of the variants
#   ARRIVALS_VARIANTS="--mixed-graph-tokens=0;defaults"  launch flags of each variant (";"
#                          between variants, word-split within; "defaults": none)
#   ARRIVALS_SAMPLING='{"temperature": 0.6, "top_p": 0.9}'  every request's sampling
#                          parameters (bench_serving.py --sampling; unset: greedy): FULL steps,
#                          as a chat model's generation_config makes them
#   ARRIVALS_TRACE=1       each run's step trace (arrivals_MODEL_ROUND_VARIANT.trace.json.gz)
#                          and `python -m cbpipe.trace`'s device time per kind of step; its
#                          engine log beside it (.engine.log; --log-level=debug says why a
#                          mixed step ran eagerly)
#   PREFIX_RUNS=system,multiturn  the prefix part's runs
#   PREFIX_REQUESTS=512           requests of the prefix part's shared-prompt run
#   PREFIX_TIMEOUT=300            seconds for each of the prefix part's two runs (both caches)
#   SAMPLING_NO_FULL_GRAPHS=1  also the sampling part's runs without the full sampler's graphs
#   SAMPLING_TESTS=1       also the sampling part's GPU tests of the full sampler
#   GEMMA2_MODES="--no-cuda-graphs --cuda-graphs --compile-decode"  the gemma2 part's steps
#   TEST_PATHS="tests/gpu kernels"  the tests part's test files or folders (word-split;
#                          "kernels": the four Triton kernel tests under tests/unit)
#   PYTEST_K=              a pytest -k expression to run part of the tests
#   TEST_TIMEOUT=480       seconds for the tests part (the suite took 361 s at 92754fa)
#   BENCH_TIMEOUT=200      seconds for each benchmark (both modes); the target part's 8B run
#                          gets TARGET_TIMEOUT=420
#   ARCH_DTYPES=bfloat16,float32  dtypes of the models part's architecture matrix
#   MODELS_TIMEOUT=270     seconds for each of the models part's matrix and tests (the two
#                          fit one call; ARCH_DTYPES=bfloat16 halves the matrix)
#   PYTHON=python
#   BYTECODE=1             0: Python as the host has it. The device's Python may not write
#                          bytecode (PYTHONDONTWRITEBYTECODE) and its torch ships none, so
#                          every launch there compiles torch's sources again (4-9 s of each
#                          start-up), which an installed environment never does (pip writes
#                          bytecode at install). By default the parts write it under
#                          /tmp/cbpipe-pycache: a bare machine's first launch pays for it,
#                          later ones read it, as a user's second launch does
#   COMPILE_CACHE=         a folder for torch.compile's and Triton's caches (e.g. .compile-cache,
#                          ignored by git): a compiled start-up that found them warm took 98 s
#                          against 167 s cold (93 against 158 s in session 5). The device
#                          machine starts bare: the caches come back as $OUT/compile-cache.tgz;
#                          carry that file as FOLDER.tgz (.compile-cache.tgz, 10 MB, where the
#                          folder is 65 MB, over the 64 MiB a call carries): it is unpacked
#                          into the folder before anything runs
# Always written: $OUT/gpu_clocks.csv, nvidia-smi's clocks, power and clock event reasons every
# 0.5 s, summarised over the samples with the GPU busy at the end of summary.log.
set -uo pipefail

OUT=${OUT:-out}  # the device tool sets it; `make gpu-check` writes to ./out
export PYTHONUNBUFFERED=1
host_dont_write_bytecode=${PYTHONDONTWRITEBYTECODE-}
if [ "${BYTECODE:-1}" = 1 ]; then
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/cbpipe-pycache}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/bench.py imports cbpipe
PY=${PYTHON:-python}
BENCH_SCALE=${BENCH_SCALE:-1}
BENCH_OUTPUT_LEN=${BENCH_OUTPUT_LEN:-1024}
BENCH_1B_REQUESTS=${BENCH_1B_REQUESTS:-256}
TEST_TIMEOUT=${TEST_TIMEOUT:-480}
TARGET_TIMEOUT=${TARGET_TIMEOUT:-420}
PARTS=${PARTS:-tests,micro,bench}
BENCH_MODES=${BENCH_MODES:-async,sync}
BENCH_MODELS=${BENCH_MODELS:-llama8b,llama1b}
TARGET_RUNS=${TARGET_RUNS:-llama8b,llama1b}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-200}
read -r -a bench_extra <<<"${BENCH_EXTRA:-}"
output_len=$((BENCH_OUTPUT_LEN / BENCH_SCALE))
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # the startup part launches from other folders too
if [ -n "${COMPILE_CACHE:-}" ]; then
    mkdir -p "$COMPILE_CACHE"
    if [ -f "$COMPILE_CACHE.tgz" ]; then
        tar xzf "$COMPILE_CACHE.tgz" -C "$COMPILE_CACHE"
    fi
    COMPILE_CACHE=$(cd "$COMPILE_CACHE" && pwd)
    export TORCHINDUCTOR_CACHE_DIR="$COMPILE_CACHE/inductor" TRITON_CACHE_DIR="$COMPILE_CACHE/triton"
fi
# The GPU's clocks, power and slowdown reasons twice a second for the whole script: a long
# memory-bound run may be slower per step than a short profile because the GPU holds lower
# clocks under its power cap, and only a log taken during the run can tell.
clock_fields=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,utilization.gpu
clock_monitor=
for reasons in clocks_event_reasons.active clocks_throttle_reasons.active; do
    if nvidia-smi --query-gpu="$clock_fields,$reasons" --format=csv >/dev/null 2>&1; then
        nvidia-smi --query-gpu="$clock_fields,$reasons" --format=csv,nounits -lms 500 \
            >"$OUT/gpu_clocks.csv" 2>&1 &
        clock_monitor=$!
        break
    fi
done
finish() {
    [ -z "$clock_monitor" ] || kill "$clock_monitor" 2>/dev/null
    [ -z "${COMPILE_CACHE:-}" ] || tar czf "$OUT/compile-cache.tgz" -C "$COMPILE_CACHE" . 2>/dev/null
}
trap finish EXIT
started=$SECONDS

section() { printf '\n===== %s (t=%ds) =====\n' "$*" $((SECONDS - started)); }

profile_log() {  # profile_log LINES ARGS...: scripts/profile_step.py ARGS, its output shown
    local lines=$1 rc
    shift
    timeout -k 10 240 "$PY" scripts/profile_step.py "$@" >"$OUT/.profile.log" 2>&1
    rc=$?
    # The profile's table first (from its first line: inductor's autotuning prints before
    # it); a failure's cause is at the end.
    sed -n '/^runner ready/,$p' "$OUT/.profile.log" | grep -v '^USDT' | head -"$lines"
    [ "$rc" = 0 ] || { echo "..."; tail -25 "$OUT/.profile.log"; }
    rm -f "$OUT/.profile.log"
    echo "exit code $rc"
}

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
for name in ("zmq", "msgpack", "numpy", "pytest", "fastapi", "uvicorn", "pydantic",
             "prometheus_client", "uvloop", "httptools"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except ImportError:
        print(f"{name} MISSING")
EOF
    echo "bytecode: ${PYTHONPYCACHEPREFIX:-as the host has it (BYTECODE=0)}" \
        "(the host's PYTHONDONTWRITEBYTECODE: ${host_dont_write_bytecode:-unset})"
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

want() { [[ ",$PARTS," == *",$1,"* ]]; }
rcs=()

if want tests; then
    section tests
    test_paths=()
    for path in ${TEST_PATHS:-tests/gpu kernels}; do
        if [[ $path == kernels ]]; then
            test_paths+=(tests/unit/test_paged_decode_kernel.py tests/unit/test_paged_prefill_kernel.py
                tests/unit/test_cache_write_kernel.py tests/unit/test_greedy_sample_kernel.py
                tests/unit/test_truncation_kernel.py tests/unit/test_full_sample_kernel.py
                tests/unit/test_state_counts_kernel.py tests/unit/test_sampler.py)
        else
            test_paths+=("$path")
        fi
    done
    timeout -k 30 "$TEST_TIMEOUT" "$PY" -m pytest "${test_paths[@]}" \
        -m gpu -v -s --durations=15 ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/gpu_tests.log"
    rcs+=("tests=${PIPESTATUS[0]}")
fi

if want micro; then
    {
        section "attention kernels"
        timeout -k 10 120 "$PY" scripts/bench_attention.py --json "$OUT/attention.json"
        echo "exit code $?"
        section "matrix products alone, random:llama-8b"
        timeout -k 10 120 "$PY" scripts/bench_matmul.py --model random:llama-8b --batch 32 256
        echo "exit code $?"
        for graphs in --no-cuda-graphs --cuda-graphs; do
            section "one decode step, random:llama-8b x32, context 4096, $graphs"
            timeout -k 10 120 "$PY" scripts/profile_step.py --model random:llama-8b --batch 32 \
                --context 4096 --steps 30 "$graphs" 2>&1 | grep -v '^USDT' | head -45
            echo "exit code ${PIPESTATUS[0]}"
        done
        for prefill in torch triton; do
            section "one mixed step, random:llama-1b: 200 decodes at context 512 + 2 prefills" \
                "of 900, prefill attention $prefill"
            timeout -k 10 120 "$PY" scripts/profile_step.py --model random:llama-1b \
                --batch 200 --context 512 --steps 20 --prefill-len 900 --prefill-seqs 2 \
                --prefill-attention-backend "$prefill" 2>&1 | grep -v '^USDT' | head -45
            echo "exit code ${PIPESTATUS[0]}"
        done
    } 2>&1 | tee "$OUT/micro.log"
    rcs+=("micro=$(grep '^exit code' "$OUT/micro.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want mixed; then
    {
        IFS=, read -r -a makeups <<<"${MIXED_MAKEUPS:-253:127:3,64:512:4}"
        IFS=';' read -r -a mixed_modes <<<"${MIXED_MODES:---no-compile-decode;--compile-decode;--compile-decode --mixed-graph-tokens=2176}"
        for makeup in "${makeups[@]}"; do
            IFS=: read -r decodes chunk chunks <<<"$makeup"
            for mode in "${mixed_modes[@]}"; do
                section "mixed step, random:${MIXED_MODEL:-llama-1b}: $decodes decodes at context" \
                    "${MIXED_CONTEXT:-640} + $chunks chunks of $chunk, $mode"
                # --no-compile-decode (profile_step.py's default) only names the run; a mode's
                # flags are word-split on purpose.
                # shellcheck disable=SC2086
                profile_log 40 --model "random:${MIXED_MODEL:-llama-1b}" --dtype bfloat16 \
                    --batch "$decodes" --context "${MIXED_CONTEXT:-640}" --prefill-len "$chunk" \
                    --prefill-seqs "$chunks" --steps 30 --profile --profile-rows 14 \
                    ${mode#--no-compile-decode}
            done
        done
    } 2>&1 | tee "$OUT/mixed.log"
    rcs+=("mixed=$(grep '^exit code' "$OUT/mixed.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want gemm; then
    {
        section "tiled split-K candidate, ${GEMM_MODEL:-random:llama-1b}, batch ${GEMM_BATCH:-256}"
        timeout -k 10 "${GEMM_TIMEOUT:-300}" "$PY" scripts/bench_matmul.py --self-check
        # shellcheck disable=SC2086  # the batches are word-split on purpose
        timeout -k 10 "${GEMM_TIMEOUT:-300}" "$PY" scripts/bench_matmul.py --only-candidate \
            --model "${GEMM_MODEL:-random:llama-1b}" --batch ${GEMM_BATCH:-256} \
            --json "$OUT/matmul.json"
        echo "exit code $?"
    } 2>&1 | tee "$OUT/gemm.log"
    rcs+=("gemm=$(grep '^exit code' "$OUT/gemm.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want chain; then
    {
        section "a decode layer's chain, ${CHAIN_MODEL:-random:llama-8b} x${CHAIN_ROWS:-32}, context ${CHAIN_CONTEXT:-0}"
        timeout -k 10 120 "$PY" scripts/bench_layer_chain.py --self-check
        timeout -k 10 "${CHAIN_TIMEOUT:-240}" "$PY" scripts/bench_layer_chain.py \
            --model "${CHAIN_MODEL:-random:llama-8b}" --rows "${CHAIN_ROWS:-32}" \
            --layers "${CHAIN_LAYERS:-32}" --context "${CHAIN_CONTEXT:-0}" \
            ${CHAIN_FLAGS:-} --kernels --json "$OUT/chain.json"
        echo "exit code $?"
    } 2>&1 | tee "$OUT/chain.log"
    rcs+=("chain=$(grep '^exit code' "$OUT/chain.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want step; then
    {
        for fuse in --fuse-projections --no-fuse-projections; do
            section "one decode step, random:llama-8b x32, context 4096, graph, $fuse"
            timeout -k 10 120 "$PY" scripts/profile_step.py --model random:llama-8b --batch 32 \
                --context 4096 --steps 30 "$fuse" 2>&1 | grep -v '^USDT' | head -30
            echo "exit code ${PIPESTATUS[0]}"
        done
    } 2>&1 | tee "$OUT/step.log"
    rcs+=("step=$(grep '^exit code' "$OUT/step.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want layout; then
    {
        for layout in "" --engine-block-layout; do
            section "one decode step, random:llama-8b x32, context 4096, graph ${layout:-(blocks together)}"
            timeout -k 10 150 "$PY" scripts/profile_step.py --model random:llama-8b --batch 32 \
                --context 4096 --steps 30 $layout 2>&1 | grep -v '^USDT' | head -30
            echo "exit code ${PIPESTATUS[0]}"
        done
    } 2>&1 | tee "$OUT/layout.log"
    rcs+=("layout=$(grep '^exit code' "$OUT/layout.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want step1b; then
    {
        if [ "${STEP1B_ATTENTION:-1}" = 1 ]; then
            sweep64=${STEP1B_SWEEP64-256x640}
            section "attention kernel, head_dim 64, batch 256, context 640" \
                "${sweep64:+with a sweep of $sweep64}"
            timeout -k 10 240 "$PY" scripts/bench_attention.py --no-prefill --head-dim 64 \
                --batches 256 --contexts 640 ${sweep64:+--sweep --sweep-cases "$sweep64"} \
                --json "$OUT/attention_1b.json"
            echo "exit code $?"
            section "attention kernel, head_dim 128 (the 8B's), batches 32 and 256" \
                "${STEP1B_SWEEP128:+with a sweep of $STEP1B_SWEEP128}"
            timeout -k 10 300 "$PY" scripts/bench_attention.py --no-prefill --batches 32,256 \
                --contexts 640,4096 ${STEP1B_SWEEP128:+--sweep --sweep-cases "$STEP1B_SWEEP128"} \
                --json "$OUT/attention_128.json"
            echo "exit code $?"
        fi
        IFS=, read -r -a profiles <<<"${STEP1B_PROFILES-llama-1b:256:640}"
        for profile in ${profiles[@]+"${profiles[@]}"}; do
            IFS=: read -r model batch context flags <<<"$profile"
            section "one decode step, random:$model x$batch, context $context, --compile-decode" \
                "${flags:+$flags}"
            # shellcheck disable=SC2086  # the flags are word-split on purpose
            profile_log 60 --model "random:$model" --batch "$batch" --context "$context" \
                --steps 30 --compile-decode $flags
        done
    } 2>&1 | tee "$OUT/step1b.log"
    rcs+=("step1b=$(grep '^exit code' "$OUT/step1b.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want imports; then
    {
        section "bytecode: may this Python write it, and do the libraries ship it"
        "$PY" - <<'PYEOF'
import importlib.util, os, sys
print("dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix,
      "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"))
for name in ("torch", "transformers", "sympy", "zmq"):
    spec = importlib.util.find_spec(name)
    folder = os.path.dirname(spec.origin) if spec and spec.origin else None
    cache = folder and os.path.join(folder, "__pycache__")
    cached = cache and os.path.isdir(cache) and len(os.listdir(cache))
    print(name, folder, "pycs:", cached, "writable:", bool(folder and os.access(folder, os.W_OK)))
PYEOF
        # Twice as the host has it, then twice with a bytecode cache it can write (as a
        # pip-installed environment has its bytecode from the install on).
        for attempt in first second prefix-first prefix-second; do
            section "imports of cbpipe.launcher, $attempt time"
            prefix=(env -u PYTHONPYCACHEPREFIX
                ${host_dont_write_bytecode:+PYTHONDONTWRITEBYTECODE=$host_dont_write_bytecode})
            [[ $attempt == prefix-* ]] &&
                prefix=(env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/cbpipe-imports-pycache)
            begun=$(date +%s%N)
            ${prefix[@]+"${prefix[@]}"} "$PY" -X importtime -c 'import cbpipe.launcher' \
                2>"$OUT/importtime.txt"
            echo "exit code $?, wall $(( ($(date +%s%N) - begun) / 1000000 )) ms"
            grep '^import time:' "$OUT/importtime.txt" | sort -t'|' -k2 -n -r | head -12
        done
        rm -f "$OUT/importtime.txt"
    } 2>&1 | tee "$OUT/imports.log"
    rcs+=("imports=$(grep '^exit code' "$OUT/imports.log" | awk '{print $3}' | tr -d , | paste -sd/ -)")
fi

if want hostcpu; then
    {
        section "the host's CPU"
        lscpu | grep -E "Model name|MHz|^CPU\(s\)|Thread|Socket|NUMA node\(s\)"
        at_1b_shape() {  # at_1b_shape TITLE REQUESTS FLAGS...: bench_scheduler.py, 128 + output
            section "bench_scheduler.py at the 1B bench's shape, $1"
            "$PY" scripts/bench_scheduler.py --num-requests "$2" --max-num-seqs "$seqs" \
                --max-batch-tokens "$tokens" --prompt-len 128 128 \
                --output-len "$output_len" "$output_len" "${@:3}" \
                | grep -E "intake|decode-only|with prefill"
            echo "exit code ${PIPESTATUS[0]}"
        }
        seqs=${HOSTCPU_SEQS:-256}
        tokens=$((seqs > 256 ? 8192 : 2048))
        for run in $(seq "${HOSTCPU_RUNS:-3}"); do
            at_1b_shape "run $run, $seqs sequences" "$seqs"
        done
        for interval in ${HOSTCPU_INTERVALS-1 3}; do
            at_1b_shape "$interval ms between steps, $seqs sequences" "$seqs" \
                --step-interval-ms "$interval"
        done
        seqs=256 tokens=2048
        for fraction in ${HOSTCPU_STRUCTURED:-}; do
            at_1b_shape "$fraction under a JSON schema" 768 --structured "$fraction" \
                --tokenizer synthetic:128000
        done
    } 2>&1 | tee "$OUT/hostcpu.log"
    rcs+=("hostcpu=$(grep '^exit code' "$OUT/hostcpu.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want bench; then
    {
        if [[ ",$BENCH_MODELS," == *",llama8b,"* ]]; then
            bench llama8b --model random:llama-8b --num-requests 32 --prompt-len 128 \
                --output-len "$output_len"
            echo "exit code $?"
        fi
        if [[ ",$BENCH_MODELS," == *",llama1b,"* ]]; then
            BENCH_MODES=${BENCH_1B_MODES:-$BENCH_MODES} bench llama1b --model random:llama-1b \
                --num-requests "$BENCH_1B_REQUESTS" \
                --prompt-len 128 --output-len "$output_len" --trace-dir "$OUT/traces1b_256"
            echo "exit code $?"
            if [ -n "${BENCH_1B_TOKENIZER:-}" ]; then
                # The same run with a tokenizer, so the scheduler's text stage decodes every
                # sampled token, as it does for any model that has one.
                tokenizer_dir=/tmp/cbpipe-bench-tokenizer-$BENCH_1B_TOKENIZER
                mkdir -p "$tokenizer_dir"
                "$PY" -c "import shutil, sys; sys.path.insert(0, 'scripts')
from bench_scheduler import synthetic_tokenizer
shutil.copy(synthetic_tokenizer($BENCH_1B_TOKENIZER), '$tokenizer_dir/tokenizer.json')"
                BENCH_MODES=${BENCH_1B_MODES:-$BENCH_MODES} bench llama1b_text \
                    --model random:llama-1b --num-requests "$BENCH_1B_REQUESTS" \
                    --prompt-len 128 --output-len "$output_len" \
                    --launch-arg=--tokenizer="$tokenizer_dir" --trace-dir "$OUT/traces1b_text"
                echo "exit code $?"
                # And with the text made in the client, as the HTTP server makes it.
                BENCH_MODES=${BENCH_1B_MODES:-$BENCH_MODES} bench llama1b_text_here \
                    --model random:llama-1b --num-requests "$BENCH_1B_REQUESTS" \
                    --prompt-len 128 --output-len "$output_len" \
                    --launch-arg=--tokenizer="$tokenizer_dir" --client-tokenizer "$tokenizer_dir" \
                    --trace-dir "$OUT/traces1b_text_here"
                echo "exit code $?"
            fi
        fi
    } 2>&1 | tee "$OUT/bench.log"
    rcs+=("bench=$(grep '^exit code' "$OUT/bench.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want ramp; then
    {
        : "${RAMP_STEPS:=8-20}"
        CBPIPE_PROFILE_STEPS=$RAMP_STEPS CBPIPE_PROFILE_DIR="$OUT/ramp_profile" BENCH_MODES=async \
            bench ramp1b --model random:llama-1b --num-requests "$BENCH_1B_REQUESTS" \
            --prompt-len 128 --output-len "$output_len" --trace-dir "$OUT/traces_ramp"
        echo "exit code $?"
        "$PY" scripts/profile_summary.py "$OUT/ramp_profile/steps_$RAMP_STEPS.json.gz" \
            --top 25 >"$OUT/ramp_profile.txt"
        echo "exit code $?"
        head -3 "$OUT/ramp_profile.txt"
    } 2>&1 | tee "$OUT/ramp.log"
    rcs+=("ramp=$(grep '^exit code' "$OUT/ramp.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want startup; then
    {
        if [ -n "${STARTUP_CHECKPOINT:-}" ]; then
            STARTUP_MODEL=/tmp/cbpipe-checkpoint-${STARTUP_CHECKPOINT#random:}
            [ -f "$STARTUP_MODEL/config.json" ] ||
                "$PY" scripts/save_checkpoint.py save "$STARTUP_CHECKPOINT" "$STARTUP_MODEL" \
                    --device cuda
        fi
        section "warm start-ups of ${STARTUP_MODEL:=random:llama-8b}"
        IFS=';' read -r -a startup_variants <<<"${STARTUP_VARIANTS-;--no-saved-traces}"
        trees=("$PWD" ${STARTUP_BASELINE:+"$(cd "$STARTUP_BASELINE" && pwd)"})
        launch() {  # launch NAME ROUND FLAGS: 4 short requests; the start-up from bench's JSON
            local name=$1 round=$2
            shift 2
            local flags=()
            read -r -a flags <<<"$*"
            local order=("${trees[@]}")
            ((round % 2)) || order=("${trees[@]:1}" "${trees[0]}")
            ((round)) || order=("$PWD")  # round 0, the warming launch: the cache is shared
            local tree
            for tree in "${order[@]}"; do
                if [ "${STARTUP_EVICT:-0}" = 1 ] && [ -n "${STARTUP_CHECKPOINT:-}" ]; then
                    "$PY" scripts/save_checkpoint.py evict "$STARTUP_MODEL"
                fi
                local run=$name
                [ "$tree" = "$PWD" ] || run=${name}_base
                (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" timeout -k 30 "$BENCH_TIMEOUT" \
                    "$PY" scripts/bench.py --model "$STARTUP_MODEL" \
                    --num-requests 4 --prompt-len 16 --output-len 16 --modes async \
                    --launch-arg=--log-level=info \
                    ${flags[@]+"${flags[@]/#/--launch-arg=}"} --json "$OUT/startup_$run.json" |
                    grep -E "start-up|captured|engine start|saved|imports and checks| ready: |weights read"
                    exit "${PIPESTATUS[0]}")
                echo "$run [${flags[*]}]: exit code $?"
            done
        }
        [ "${STARTUP_WARMING:-1}" = 0 ] || launch warming 0
        for round in $(seq "${STARTUP_REPEATS:-2}"); do
            for index in "${!startup_variants[@]}"; do
                launch "r${round}_v${index}" "$round" "${startup_variants[$index]}"
            done
        done
    } 2>&1 | tee "$OUT/startup.log"
    rcs+=("startup=$(grep -c 'exit code 0' "$OUT/startup.log") ok")
fi

if want target; then
    {
        if [[ ",$TARGET_RUNS," == *",llama8b,"* ]]; then
            BENCH_TIMEOUT=$TARGET_TIMEOUT bench target8b --model random:llama-8b \
                --num-requests 32 --prompt-len 256 --output-len $((8192 / BENCH_SCALE)) \
                --trace-dir "$OUT/traces8b"
            echo "exit code $?"
        fi
        if [[ ",$TARGET_RUNS," == *",llama1b,"* ]]; then
            BENCH_MODES=${TARGET_1B_MODES:-async} bench target1b --model random:llama-1b \
                --num-requests 1024 --trace-dir "$OUT/traces1b" \
                --random-prompt-len 64,1024 --random-output-len 64,$((512 / BENCH_SCALE)) --seed 0
            echo "exit code $?"
        fi
    } 2>&1 | tee "$OUT/target.log"
    rcs+=("target=$(grep '^exit code' "$OUT/target.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want compile; then
    {
        section "one decode step, random:llama-8b x32, context 4096, --compile-decode"
        timeout -k 10 "${COMPILE_TIMEOUT:-300}" "$PY" scripts/profile_step.py \
            --model random:llama-8b --batch 32 --context 4096 --steps 30 --compile-decode 2>&1 \
            | grep -v '^USDT' | head -45
        echo "exit code ${PIPESTATUS[0]}"
    } 2>&1 | tee "$OUT/compile.log"
    rcs+=("compile=$(grep '^exit code' "$OUT/compile.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want truncation; then
    {
        section "top-k/top-p truncation: the kernel against the sort"
        timeout -k 10 300 "$PY" scripts/bench_truncation.py --rows "${TRUNCATION_ROWS:-1,32,64,256}" ${TRUNCATION_KERNELS:+--kernels} \
            ${TRUNCATION_LAUNCH:+--launch "$TRUNCATION_LAUNCH"} --json "$OUT/truncation.json" 2>&1
        echo "exit code ${PIPESTATUS[0]}"
        section "truncation and sampler kernels GPU tests"
        timeout -k 30 "$TEST_TIMEOUT" "$PY" -m pytest tests/unit/test_truncation_kernel.py \
            tests/unit/test_full_sample_kernel.py tests/unit/test_state_counts_kernel.py \
            tests/unit/test_sampler.py -m gpu \
            -q --durations=5 2>&1
        echo "exit code ${PIPESTATUS[0]}"
    } 2>&1 | tee "$OUT/truncation.log"
    rcs+=("truncation=$(grep '^exit code' "$OUT/truncation.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want sampling; then
    {
        presets=greedy,random,full,full-logprobs,penalties,greedy-logprobs
        for run in "random:llama-8b 32 4096" "random:llama-1b 256 512"; do
            read -r model batch context <<<"$run"
            section "sampling presets, $model x$batch, context $context, graphs"
            timeout -k 10 200 "$PY" scripts/profile_step.py --model "$model" --batch "$batch" \
                --context "$context" --steps 30 --all-buckets --sampling "$presets" 2>&1 \
                | grep -v '^USDT'
            echo "exit code ${PIPESTATUS[0]}"
            [ "${SAMPLING_NO_FULL_GRAPHS:-1}" = 1 ] || continue
            section "sampling presets, $model x$batch, context $context, no full-sampler graphs"
            timeout -k 10 200 "$PY" scripts/profile_step.py --model "$model" --batch "$batch" \
                --context "$context" --steps 30 --all-buckets --no-full-graphs \
                --sampling greedy,full,penalties 2>&1 | grep -v '^USDT'
            echo "exit code ${PIPESTATUS[0]}"
        done
        if [ "${SAMPLING_COMPILE:-0}" = 1 ]; then
            section "sampling presets, random:llama-8b x32, context 4096, --compile-decode"
            timeout -k 10 "${COMPILE_TIMEOUT:-300}" "$PY" scripts/profile_step.py \
                --model random:llama-8b --batch 32 --context 4096 --steps 30 --all-buckets \
                --compile-decode --sampling "$presets" 2>&1 | grep -v '^USDT'
            echo "exit code ${PIPESTATUS[0]}"
        fi
        if [ "${SAMPLING_TESTS:-1}" = 1 ]; then
            section "full sampler GPU tests"
            timeout -k 30 "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu/test_full_sampling.py -m gpu \
                -v --durations=10 ${PYTEST_K:+-k "$PYTEST_K"} 2>&1
            echo "exit code ${PIPESTATUS[0]}"
        fi
    } 2>&1 | tee "$OUT/sampling.log"
    rcs+=("sampling=$(grep '^exit code' "$OUT/sampling.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want models; then
    {
        section "architecture matrix (${ARCH_DTYPES:-bfloat16,float32}), engine against generate"
        timeout -k 10 "${MODELS_TIMEOUT:-270}" "$PY" scripts/check_architectures.py --device cuda \
            --dtypes "${ARCH_DTYPES:-bfloat16,float32}" --json "$OUT/architectures.json" 2>&1 \
            | grep -v -e '^Loading weights' -e '^Writing model shards' -e 'RoPE scaling factor'
        echo "exit code ${PIPESTATUS[0]}"
        section "attention kernels' GPU cases and the variant models on the GPU"
        timeout -k 10 "${MODELS_TIMEOUT:-270}" "$PY" -m pytest -m gpu -q -s --durations=10 \
            tests/unit/test_paged_decode_kernel.py tests/unit/test_paged_prefill_kernel.py \
            tests/gpu/test_architectures_gpu.py 2>&1 | tail -40
        echo "exit code ${PIPESTATUS[0]}"
    } 2>&1 | tee "$OUT/models.log"
    rcs+=("models=$(grep '^exit code' "$OUT/models.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want gemma2; then
    {
        for graphs in ${GEMMA2_MODES:---no-cuda-graphs --cuda-graphs --compile-decode}; do
            section "one decode step, random:gemma2-2b x32, context 8192, $graphs"
            timeout -k 10 "${COMPILE_TIMEOUT:-300}" "$PY" scripts/profile_step.py \
                --model random:gemma2-2b --batch 32 --context 8192 --steps 30 "$graphs" 2>&1 \
                | grep -v '^USDT' | head -40
            echo "exit code ${PIPESTATUS[0]}"
        done
    } 2>&1 | tee "$OUT/gemma2.log"
    rcs+=("gemma2=$(grep '^exit code' "$OUT/gemma2.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want serving; then
    {
        if [[ ",${SERVING_RUNS:-llama1b,llama8b}," == *",llama1b,"* ]]; then
            for servers in ${SERVING_1B_SERVERS:-1 4}; do
                section "serving random:llama-1b, 256 streams, HTTP ($servers server processes) and ZeroMQ"
                timeout -k 30 "${SERVING_TIMEOUT:-300}" "$PY" scripts/bench_serving.py \
                    --model random:llama-1b --num-prompts 256 --max-concurrency 256 \
                    --prompt-len 128 --output-len "$output_len" --backends http,zmq \
                    --api-server-count "$servers" --json "$OUT/serving_1b_$servers.json"
                echo "exit code $?"
            done
        fi
        if [[ ",${SERVING_RUNS:-llama1b,llama8b}," == *",llama8b,"* ]]; then
            section "serving random:llama-8b over HTTP, Poisson arrivals at ${SERVING_8B_RATES:-2,8,32}/s"
            timeout -k 30 "${SERVING_TIMEOUT:-300}" "$PY" scripts/bench_serving.py \
                --model random:llama-8b --num-prompts "${SERVING_8B_PROMPTS:-128}" \
                --request-rates "${SERVING_8B_RATES:-2,8,32}" --prompt-len 128 \
                --output-len "$output_len" --backends http \
                --api-server-count "${SERVING_8B_SERVERS:-2}" --json "$OUT/serving_8b.json"
            echo "exit code $?"
        fi
        if [[ ",${SERVING_RUNS:-llama1b,llama8b}," == *",arrivals,"* ]]; then
            IFS=: read -r arrival_prompt arrival_output <<<"${ARRIVALS_LENS:-256:256}"
            IFS=';' read -r -a variants <<<"${ARRIVALS_VARIANTS:---mixed-graph-tokens=0;defaults}"
            for pair in ${ARRIVALS_MODELS:-llama-1b:64 llama-8b:16}; do
                IFS=: read -r model rate <<<"$pair"
                for round in $(seq "${ARRIVALS_ROUNDS:-2}"); do
                    for index in "${!variants[@]}"; do
                        variant=${variants[$index]}
                        section "arrivals: random:$model at $rate/s through ZeroMQ," \
                            "round $round, $variant"
                        launch_args=()
                        if [[ $variant != defaults ]]; then
                            for arg in $variant; do launch_args+=("--launch-arg=$arg"); done
                        fi
                        run_name="arrivals_${model}_${round}_$index"
                        if [[ -n ${ARRIVALS_SAMPLING:-} ]]; then
                            launch_args+=(--sampling "$ARRIVALS_SAMPLING")
                        fi
                        if [[ ${ARRIVALS_TRACE:-1} == 1 ]]; then
                            launch_args+=("--launch-arg=--trace=$OUT/$run_name.trace.json")
                        fi
                        timeout -k 30 "${SERVING_TIMEOUT:-300}" "$PY" scripts/bench_serving.py \
                            --model "random:$model" --backends zmq --request-rates "$rate" \
                            --num-prompts "${ARRIVALS_PROMPTS:-320}" \
                            --prompt-len "$arrival_prompt" --output-len "$arrival_output" \
                            "${launch_args[@]}" \
                            --json "$OUT/$run_name.json" --engine-log "$OUT/$run_name.engine.log"
                        echo "exit code $?"
                        if [[ -f $OUT/$run_name.trace.json ]]; then
                            # Past the warm-up's steps: each kind of step's device time.
                            "$PY" -m cbpipe.trace "$OUT/$run_name.trace.json" --skip-steps 40
                            gzip -f "$OUT/$run_name.trace.json"
                        fi
                    done
                done
            done
        fi
    } 2>&1 | tee "$OUT/serving.log"
    rcs+=("serving=$(grep '^exit code' "$OUT/serving.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want prefix; then
    {
        if [[ ",${PREFIX_RUNS:-system,multiturn}," == *",system,"* ]]; then
        section "shared system prompt, random:llama-8b, prefix cache on and off"
        timeout -k 30 "${PREFIX_TIMEOUT:-300}" "$PY" scripts/bench.py --model random:llama-8b \
            --num-requests "${PREFIX_REQUESTS:-512}" --shared-prefix-len 2000 \
            --random-prompt-len 50,150 --output-len $((128 / BENCH_SCALE)) --modes async \
            --compare-prefix-caching ${bench_extra[@]+"${bench_extra[@]}"} \
            --json "$OUT/prefix_8b.json"
        echo "exit code $?"
        fi
        if [[ ",${PREFIX_RUNS:-system,multiturn}," == *",multiturn,"* ]]; then
        section "multi-turn conversations, random:llama-1b, prefix cache on and off"
        timeout -k 30 "${PREFIX_TIMEOUT:-300}" "$PY" scripts/bench_multiturn.py \
            --model random:llama-1b --conversations 64 --turns 8 --new-tokens 100 \
            --output-len $((128 / BENCH_SCALE)) --json "$OUT/multiturn_1b.json"
        echo "exit code $?"
        fi
    } 2>&1 | tee "$OUT/prefix.log"
    rcs+=("prefix=$(grep '^exit code' "$OUT/prefix.log" | awk '{print $3}' | paste -sd/ -)")
fi

if want tp; then
    {
        tp_runs=${TP_RUNS:-compare,llama8b,batch1,llama70b}
        if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
            echo "the tp part needs two GPUs (nvidia-h200-x2)"
            echo "exit code 2"
        else
            if [[ ",$tp_runs," == *",compare,"* ]]; then
                section "TP=2 against TP=1, bfloat16, a random llama-8b checkpoint"
                timeout -k 30 "${TP_COMPARE_TIMEOUT:-540}" "$PY" -m pytest \
                    tests/gpu/test_tensor_parallel_gpu.py -m gpu -v -s
                echo "exit code $?"
            fi
            for size in 1 2; do
                if [[ ",$tp_runs," == *",llama8b,"* ]]; then
                    BENCH_MODES=async bench "tp${size}_8b" --model random:llama-8b \
                        --num-requests 32 --prompt-len 128 --output-len "$output_len" \
                        --launch-arg="--tensor-parallel-size=$size"
                    echo "exit code $?"
                fi
                if [[ ",$tp_runs," == *",batch1,"* ]]; then
                    BENCH_MODES=async bench "tp${size}_8b_batch1" --model random:llama-8b \
                        --num-requests 1 --prompt-len 128 --output-len "$output_len" \
                        --launch-arg="--tensor-parallel-size=$size"
                    echo "exit code $?"
                fi
            done
            if [[ ",$tp_runs," == *",llama70b,"* ]]; then
                BENCH_MODES=async BENCH_TIMEOUT=${TP_70B_TIMEOUT:-540} bench tp2_70b \
                    --model random:llama-70b --num-requests 32 --prompt-len 128 \
                    --output-len "$output_len" --launch-arg="--tensor-parallel-size=2"
                echo "exit code $?"
            fi
        fi
    } 2>&1 | tee "$OUT/tp.log"
    rcs+=("tp=$(grep '^exit code' "$OUT/tp.log" | awk '{print $3}' | paste -sd/ -)")
fi

{
    section summary
    echo "PARTS=$PARTS exit codes: ${rcs[*]} (124: timed out); BENCH_SCALE=$BENCH_SCALE"
    echo "total $((SECONDS - started)) s"
    grep -h -A 10 '^model ' "$OUT"/bench.log "$OUT"/target.log "$OUT"/tp.log 2>/dev/null || true
    grep -h 'TP=2 vs TP=1' "$OUT"/tp.log 2>/dev/null || true
    grep -h -A 30 '^model ' "$OUT"/prefix.log 2>/dev/null || true
    grep -h -E '^(runner ready|per step|=====)' "$OUT"/sampling.log 2>/dev/null || true
    grep -h -e 'architectures match exactly' -e '^refused as expected' "$OUT"/models.log \
        2>/dev/null || true
    grep -h -e '^=====' -e '^per step' -e '^bandwidth floor' "$OUT"/gemma2.log 2>/dev/null || true
    grep -h -E '^(===== serving|backend |http |zmq |    error|.*HTTP throughput)' \
        "$OUT"/serving.log 2>/dev/null || true
    [ ! -s "$OUT/gpu_clocks.csv" ] || "$PY" - "$OUT/gpu_clocks.csv" <<'EOF'
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) == 8 and r[6].strip().isdigit()]
busy = [r for r in rows if int(r[6]) >= 50]  # samples with the GPU at least half busy
for name, i in (("SM MHz", 1), ("memory MHz", 2), ("power W", 3), ("temperature C", 5)):
    values = sorted(float(r[i]) for r in busy if r[i].strip().replace(".", "", 1).isdigit())
    if values:
        print(f"GPU busy samples: {name} min {values[0]:g} median "
              f"{statistics.median(values):g} max {values[-1]:g}")
if busy:
    reasons = " ".join(sorted({r[7].strip() for r in busy}))
    print(f"GPU busy samples: {len(busy)}, power limit {busy[0][4].strip()} W, "
          f"clock event reasons seen: {reasons}")
EOF
    echo "engine processes left: $(pgrep -f 'cbpipe.launcher' | paste -sd' ' - || true)"
} 2>&1 | tee "$OUT/summary.log"
for rc in "${rcs[@]}"; do
    [[ "${rc#*=}" =~ ^0(/0)*$ ]] || exit 1
done
