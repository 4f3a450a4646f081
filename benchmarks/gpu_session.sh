#!/usr/bin/env bash
# The GPU session: one prepared run of at most 8 minutes on a lent H100 or H200 (jax 0.11.2 with the CUDA 13 plugin,
# Triton, torch; nothing can be fetched there). Each step has its own timeout and writes into $OUT as it goes, so a
# timeout loses only the step in flight (the python steps write their JSON after every case):
#   env       versions, the GPU, fla-core installed from benchmarks/wheels into a throwaway folder (no index)
#   tests     pytest -m gpu tests/pallas_kernels: the Triton-compiled kernels against the pure-JAX references, f32 and
#             bf16 (test_gpu_numerics.py also checks that the public ops lower to Triton calls on this GPU)
#   kernels   benchmarks/gpu_kernels.py: copy bandwidth and bf16 GEMM rate, then the kernels at Qwen3-Next-80B TP-4
#             per-device shapes, fla-core beside them
#   step      benchmarks/gpu_step.py: Nemotron-H-8B engine steps against benchmarks/results/estimate.json
# $OUT gets session.txt (each step's exit status and seconds), one log per step and gpu_kernels.json, gpu_step.json:
# 7 files, within the 8 a run returns. Nothing to carry: the wheels are committed (benchmarks/wheels, 1.1 MB).
#   run:      bash benchmarks/gpu_session.sh
#   dry run:  bash benchmarks/gpu_session.sh --dry-run   (CPU, under a minute: every file, flag and wheel the run needs,
#             pytest's collection of the GPU tests, and each python step's code path on tiny shapes)
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
PY=${PYTHON:-python3}  # on the lent machines python3 is the one with jax, torch and Triton
OUT=${OUT:-$( ((DRY_RUN)) && mktemp -d /tmp/gpu_session_dry.XXXX || echo /tmp/gpu_session)}
FLA_DIR=$(mktemp -d /tmp/fla_site.XXXX)  # the carried wheels, installed here only
mkdir -p "$OUT"

STEPS=(env tests kernels step)
declare -A LIMIT=([env]=20 [tests]=100 [kernels]=165 [step]=175)  # seconds; the budget below checks their sum
GRACE=3  # SIGKILL this long after timeout's SIGTERM
BUDGET=480
WHEELS=(benchmarks/wheels/fla_core-0.6.0-py3-none-any.whl benchmarks/wheels/einops-0.8.2-py3-none-any.whl)
NEEDED=(benchmarks/gpu_kernels.py benchmarks/gpu_step.py benchmarks/roofline.py benchmarks/estimate.py
        benchmarks/aot_step.py benchmarks/results/estimate.json configs/models/qwen3_next_80b_a3b_instruct.yaml
        configs/models/nemotron_h_8b_base_8k.yaml configs/models/tiny_nemotron_h.yaml
        tests/pallas_kernels/test_gpu_numerics.py "${WHEELS[@]}")
# The commands the steps run; the dry run runs the same ones with its own flags appended.
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider -m gpu -n 4 --dist loadfile -o console_output_style=classic
        tests/pallas_kernels)
KERNELS=("$PY" benchmarks/gpu_kernels.py --out "$OUT")
STEP=("$PY" benchmarks/gpu_step.py --out "$OUT")

export PYTHONPATH=$PWD:$FLA_DIR PYTHONUNBUFFERED=1 CI=1  # CI: hypothesis replays the same examples, no database
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # pytest's workers, and torch beside jax, share the GPU
if ((DRY_RUN)); then
    # one CPU, no GPU plugin probing; compiles of the tiny shapes need no LLVM optimisation
    export JAX_PLATFORMS=cpu JAX_DISABLE_MOST_OPTIMIZATIONS=1
fi

log() { echo "$*" | tee -a "$OUT/session.txt"; }

check_budget() {
    local total=0 name
    for name in "${STEPS[@]}"; do total=$((total + LIMIT[$name] + GRACE)); done
    local each
    each=$(for name in "${STEPS[@]}"; do printf '%s %s s, ' "$name" "${LIMIT[$name]}"; done)
    log "budget: ${total} s of ${BUDGET} s (${each}+${GRACE} s grace each)"
    ((total < BUDGET))
}

check_files() {
    local missing=0 path tool
    for path in "${NEEDED[@]}"; do [[ -f $path ]] || { log "missing: $path"; missing=1; }; done
    for tool in timeout tee "$PY"; do
        command -v "$tool" >/dev/null || { log "missing command: $tool"; missing=1; }
    done
    return $missing
}

step_env() {  # what the GPU and its software are; fla-core from the committed wheels, no index
    command -v nvidia-smi >/dev/null &&
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c 'import jax, jaxlib, sys
print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())' || return 1
    # without a GPU every step would skip or stop: say so here, at once
    ((DRY_RUN)) || "$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices()' || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$FLA_DIR" "${WHEELS[@]}" || return 1
    local ops=$FLA_DIR/fla/ops/gated_delta_rule/__init__.py  # the two ops gpu_kernels.py calls
    grep -q fused_recurrent_gated_delta_rule "$ops" && grep -q chunk_gated_delta_rule "$ops" ||
        { echo "fla-core lacks the ops"; return 1; }
    echo "fla-core wheel installed in $FLA_DIR"
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                                            "cuda", torch.cuda.is_available())' ||
        echo "torch/Triton do not import here: fla-core will be skipped"
}

run_step() {  # name, then its command: run under its timeout, log into $OUT/<name>.txt (and stdout unless QUIET)
    local name=$1 start=$SECONDS rc
    shift
    timeout -k "$GRACE" "${LIMIT[$name]}" "$@" 2>&1 |
        if [[ -n ${QUIET:-} ]]; then cat >"$OUT/$name.txt"; else tee "$OUT/$name.txt"; fi
    rc=$?
    local late=""
    ((rc == 124 || rc == 137)) && late=", TIMED OUT"
    log "$name: exit $rc after $((SECONDS - start)) s (limit ${LIMIT[$name]} s)$late"
    return $rc
}

dry_run() {  # CPU: the three python steps at once (two cores), each on its own log, printed if anything failed
    local failed=0 pid name
    QUIET=1 run_step tests "${PYTEST[@]}" --collect-only -n 0 & local pids=($!)
    QUIET=1 run_step kernels "${KERNELS[@]}" --dry-run & pids+=($!)
    QUIET=1 run_step step "${STEP[@]}" --dry-run & pids+=($!)
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    grep -Eq "^[1-9][0-9]*(/[0-9]+)? tests? collected" "$OUT/tests.txt" ||
        { log "tests: no GPU test collected"; failed=1; }
    if ((failed)); then for name in tests kernels step; do echo "== $name"; tail -n 30 "$OUT/$name.txt"; done; fi
    return $failed
}

: >"$OUT/session.txt"
kind=run
((DRY_RUN)) && kind="dry run"
log "gpu_session $kind at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null), OUT=$OUT"
check_budget || { log "the steps' timeouts exceed the budget"; exit 1; }
check_files || exit 1
failed=0
run_step env bash -c "$(declare -f step_env); PY='$PY' FLA_DIR='$FLA_DIR' DRY_RUN=$DRY_RUN WHEELS=(${WHEELS[*]})
                      step_env" || failed=1
if ((DRY_RUN)); then
    dry_run || failed=1
else
    run_step tests "${PYTEST[@]}" || failed=1
    run_step kernels "${KERNELS[@]}" || failed=1
    # the step's pools and weights (~66 GB at batch 256) need more than jax's default 75% of an H100
    run_step step env XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 "${STEP[@]}" || failed=1
fi
rm -rf "$FLA_DIR"
log "done: $( ((failed)) && echo 'some steps failed' || echo 'every step passed'); results in $OUT"
exit $failed
