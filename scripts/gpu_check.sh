#!/usr/bin/env bash
# A GPU check in one command, for a machine with an NVIDIA GPU and JAX (CUDA), flax, optax, orbax, chex,
# transformers and PyTorch already installed; no virtualenv, no installs, no Ray, no network (hfjax runs from this
# checkout through PYTHONPATH). In turn, each with a time limit, each kept going past a failure of another:
#   1. environment: jax/jaxlib versions, backend, device kind (fails unless JAX runs on the GPU);
#   2. parity tests on the GPU backend: tests/test_model_parity.py and tests/test_rollout.py, counts per file;
#   3. scripts/bench/bench_generate.py: hfjax vs transformers generate (both on the GPU), output tokens/s;
#   4. GRPO iterations at verl's quickstart workload: Qwen2.5-0.5B shape with random weights (built locally),
#      256 prompts x 5 samples x 512-token responses (then 256, 128 if those run out of memory), bf16,
#      trainer.backend=local (--remat: actor.remat); seconds per step and tokens/s of the steps after the first
#      (compiles), and the peak device memory of the run (JAX's allocator), to set beside `hfjax compile`'s.
# Then ONE table, also written as JSON to OUT_DIR/gpu_check.json; exit status 1 when any check failed (the table
# shows FAILED and the last lines of its log; each check's full log is OUT_DIR/<check>.log).
#
# Usage: bash scripts/gpu_check.sh [--tiny] [--out-dir runs/gpu_check] [--prompts 256] [--group 5]
#          [--response-lengths 512,256,128] [--steps 2] [--max-prompt-length 128] [--gen-prompts 64]
#          [--gen-tokens 128] [--remat none] [--timeouts PARITY,GENERATE,GRPO] [--checks env,parity,generate,grpo]
#          [--block-ray]
# --tiny: on the CPU (JAX_PLATFORMS=cpu), a few fast parity tests, the tiny reference checkpoint, 4 prompts x 8
# tokens, one GRPO step of 4 prompts x 2 samples x 16 tokens on a tiny Qwen2 model; about 2 minutes on 2 cores.
# --block-ray: `import ray` fails in the generation and GRPO checks, as on a machine without Ray (where Ray is
# installed). --checks: run only these (the others are "skipped" rows, not failures), e.g. two instances with their own
# --out-dir side by side on one GPU (with XLA_PYTHON_CLIENT_PREALLOCATE=false). PYTHON (default: python, else python3) is the interpreter.
set -u -o pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"

TINY=0
OUT_DIR=runs/gpu_check
PROMPTS=256
GROUP=5
RESPONSE_LENGTHS=512,256,128
STEPS=2
MAX_PROMPT_LENGTH=128
GEN_PROMPTS=64
GEN_TOKENS=128
# seconds: parity tests, generation benchmark, GRPO (the environment check: 120). The generation benchmark compiles
# 16 programs (14 prefill shapes, 2 decode loops; 30 s on a 2-core CPU); on an H200 (JAX 0.11.2) 90 s were not enough.
TIMEOUTS=200,240,280
CHECKS=env,parity,generate,grpo
REMAT=none
STEP=""               # internal: run one check's function (the time limit runs this script again with --step)
ARGS=("$@")
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$SELF"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --out-dir) OUT_DIR=$2; shift ;;
    --prompts) PROMPTS=$2; shift ;;
    --group) GROUP=$2; shift ;;
    --response-lengths | --response-length) RESPONSE_LENGTHS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --max-prompt-length) MAX_PROMPT_LENGTH=$2; shift ;;
    --gen-prompts) GEN_PROMPTS=$2; shift ;;
    --gen-tokens) GEN_TOKENS=$2; shift ;;
    --timeouts) TIMEOUTS=$2; shift ;;
    --checks) CHECKS=$2; shift ;;
    --remat) REMAT=$2; shift ;;
    --block-ray) export GPU_CHECK_BLOCK_RAY=1 ;;
    --step) STEP=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

case "$OUT_DIR" in /*) ;; *) OUT_DIR="$PWD/$OUT_DIR" ;; esac
cd "$(dirname "$SELF")/.." || exit 2
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PARITY_FILES=(tests/test_model_parity.py tests/test_rollout.py)
IFS=, read -r PARITY_S GENERATE_S GRPO_S <<<"$TIMEOUTS"
if [ "$TINY" = 1 ]; then
  MODE=tiny
  export JAX_PLATFORMS=cpu
  BACKEND=cpu
  # two fast tests per file: Qwen2 logits and greedy decoding against transformers, and two of the engine's own
  PARITY_TESTS=("${PARITY_FILES[0]}::test_causal_lm_logits_match_transformers[qwen2-tied-mqa]"
    "${PARITY_FILES[0]}::test_causal_lm_logits_match_transformers[qwen2-bias]"
    "${PARITY_FILES[1]}::test_greedy_equals_transformers[False-qwen2]"
    "${PARITY_FILES[1]}::test_seeds_and_stop_tokens")
  GEN_FLAGS=(--prompts 4 --new-tokens 8 --repeats 1)
  GRPO_FLAGS=(--tiny --prompts 4 --group 2 --steps 1 --max-prompt-length 32 --micro-batch 4 --response-lengths 16
    --remat "$REMAT")
else
  MODE=full
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
  BACKEND=gpu
  PARITY_TESTS=("${PARITY_FILES[@]}")
  GEN_FLAGS=(--prompts "$GEN_PROMPTS" --new-tokens "$GEN_TOKENS" --repeats 3)
  GRPO_FLAGS=(--prompts "$PROMPTS" --group "$GROUP" --steps "$STEPS" --max-prompt-length "$MAX_PROMPT_LENGTH"
    --response-lengths "$RESPONSE_LENGTHS" --remat "$REMAT")
fi
mkdir -p "$OUT_DIR"
TABLE=(scripts/gpu_check_table.py)
# run_check NAME LIMIT_S COMMAND...: runs COMMAND with its output shown and kept in OUT_DIR/NAME.log, under a time
# limit, and writes "EXIT_CODE SECONDS" to OUT_DIR/NAME.status. At the limit the command gets SIGABRT, so that its
# Python processes print where each thread was (faulthandler) before they end: a hang names its line in the log.
export PYTHONFAULTHANDLER=1
run_check() {
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name (limit ${limit}s) ==="
  start=$(date +%s.%N)
  timeout -s ABRT -k 15 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$rc $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')" >"$OUT_DIR/$name.status"
  [ "$rc" = 0 ] || echo "=== $name: FAILED (exit code $rc) ==="
}

parity() {
  # conftest.py keeps JAX_PLATFORMS from the environment (it only sets cpu as a default)
  "$PYTHON" -m pytest -q --junitxml="$OUT_DIR/parity.xml" "${PARITY_TESTS[@]}"
  local rc=$?
  "$PYTHON" "${TABLE[@]}" pytest "$OUT_DIR/parity.xml" "$OUT_DIR/parity.json" "${PARITY_FILES[@]}" || return 3
  return $rc
}

generate() {
  local ckpt="$OUT_DIR/reference-ckpt"
  [ "$TINY" = 1 ] && ckpt="$OUT_DIR/reference-ckpt-tiny"
  if [ ! -f "$ckpt/config.json" ]; then
    local tiny_flag=()
    [ "$TINY" = 1 ] && tiny_flag=(--tiny)
    "$PYTHON" scripts/bench/make_reference_ckpt.py "$ckpt.partial" "${tiny_flag[@]}" || return 3
    rm -rf "$ckpt" && mv "$ckpt.partial" "$ckpt"
  fi
  # JAX shares the GPU with PyTorch in this process: allocate on demand instead of taking 75% up front
  XLA_PYTHON_CLIENT_PREALLOCATE=false "$PYTHON" "${TABLE[@]}" generate "$OUT_DIR/generate.json" -- \
    --ckpt "$ckpt" "${GEN_FLAGS[@]}" --out "$OUT_DIR/bench_generate.json"
}

if [ -n "$STEP" ]; then
  "$STEP"
  exit $?
fi
for check in env parity generate grpo; do rm -f "$OUT_DIR/$check.status" "$OUT_DIR/$check.json" "$OUT_DIR/$check.log"; done
rm -f "$OUT_DIR/gpu_check.json" "$OUT_DIR/parity.xml"
STARTED=$(date +%s)

wanted() { case ",$CHECKS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for check in ${CHECKS//,/ }; do
  case "$check" in env | parity | generate | grpo) ;; *) echo "gpu_check.sh: --checks: unknown check $check" >&2; exit 2 ;; esac
done
wanted env && run_check env 120 "$PYTHON" "${TABLE[@]}" env "$OUT_DIR/env.json" --expect-backend "$BACKEND"
wanted parity && run_check parity "$PARITY_S" "$BASH" "$SELF" ${ARGS[@]+"${ARGS[@]}"} --out-dir "$OUT_DIR" --step parity
wanted generate && run_check generate "$GENERATE_S" "$BASH" "$SELF" ${ARGS[@]+"${ARGS[@]}"} --out-dir "$OUT_DIR" --step generate
wanted grpo && run_check grpo "$GRPO_S" "$PYTHON" "${TABLE[@]}" grpo "$OUT_DIR/grpo.json" "${GRPO_FLAGS[@]}"

GPU_CHECK_WALL_S=$(($(date +%s) - STARTED)) "$PYTHON" "${TABLE[@]}" table "$OUT_DIR" --mode "$MODE"
