#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run (CI has no GPU; run this on a CUDA machine):
#
#     OUT=gpu_results bash scripts/device_check.sh
#
# 1. the CUDA half of the KV and compiled-frame tests (fused inplace step vs the eager ring, bit for
#    bit; bench_kv's frame captured as a CUDA graph rewrites its slot on replay; the model compiled
#    whole gives the eager frames, the same frames run to run, noise drawn on the GPU, and no
#    recompile across wraps, cuts, recomputes and bias changes);
# 2. bench_kv --device cuda --cuda-graph: per-frame cache cost of every layout x codec as ratios
#    to bf16 roll, as launched and as captured CUDA graphs (kernels only), and memory (the v0-v4
#    matrix on the shipped world is left to a run of its own);
# 3. the training chain's --device cuda path on a tiny data set (generate, train_vae, encode,
#    train_world), so the stages that take --device are known to run there; train_world runs 10 s
#    at batch 64 and prints its own ms a step (its --seconds line), alone on the GPU;
# 4. bench_compile --device cuda: eager vs OWL_COMPILE=1 per cache mode, and recompiles
#    after warm-up (0 = none in steady state);
# 5. bench_frame --device cuda: ms a frame of the production-shaped model (16 layers, bf16): eager,
#    the model compiled whole (int8 in-place ring) and eager bf16 roll, 1 and 4 sessions (compiled
#    whole too); bench_frame's other paths each compile graphs of their own, left out to fit the limit;
# 5b. bench_train --device cuda: seconds a training step of the shipped world's shape at batch 64
#    (eager, compiled, one masked attention call), to set beside train_world's own (step 3);
# 6. bench_pipeline --device cuda: FPS of the shipped world and of the production-size model;
# 7. decoding beside the generator on a GPU: the headless run's float32 frames with OWL_DECODE=async
#    (a CUDA stream) and as two stages (--pp 2, both ranks on the one GPU) against the plain run's,
#    bit for bit (the headless runs write mp4s: imageio-ffmpeg's ffmpeg, or IMAGEIO_FFMPEG_EXE, must be there).
#
# Where the GPU machine has torch but not diffusers, omegaconf or imageio-ffmpeg (and no network),
# put their wheels in .whl/ beside the repository (pip download ... -d .whl); they are installed to
# /tmp/site first.
# The step limits add up to 9 minutes, so the whole check fits a 10-minute run. ORIGINAL=<folder>
# (a checkout of the original, with a rotary-embedding-torch wheel in .whl/) adds the original's
# own loop to bench_frame.
#
# STEPS="tests chain" runs only those steps. Each step has its own time limit in seconds
# (STEP_LIMIT_SCALE=2 doubles them all), so one hang cannot eat the others; each step's log is
# $OUT/<step>.log, and the last line says which steps failed.
set -u
OUT=${OUT:-gpu_results}
SCALE=${STEP_LIMIT_SCALE:-1}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=()

STEPS=" ${STEPS:-tests bench_kv chain bench_compile bench_frame bench_train bench_pipeline stages} "  # a subset: STEPS="tests bench_pipeline"

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    [[ $STEPS == *" $name "* ]] || return 0
    limit=$(awk -v a="$limit" -v s="$SCALE" 'BEGIN { printf "%d", a * s }')
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || failed+=("$name (exit $rc)")
}

nvidia-smi -L
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1

# -o addopts= : the suite's pytest-xdist options, which the GPU machine's pytest may not know
step tests 75 $PY -m pytest -q -o addopts= -p no:cacheprovider tests/test_kv_quant.py tests/test_compiled.py -k cuda
step bench_kv 90 $PY -m scripts.bench_kv --device cuda --cuda-graph --frames 4 --skip-matrix --json "$OUT/bench_kv.json"
tmp=$(mktemp -d)
step chain 80 bash -c "set -e
    $PY -m scripts.generate_data --out $tmp/data --episodes 4 --frames 48 --seed 5000
    $PY -m scripts.train_vae --data $tmp/data --out $tmp/vae --steps 20 --batch 8 --held-out 1 --save-every 20 --device cuda
    $PY -m scripts.encode_latents --data $tmp/data --vae checkpoints/maze-world/vae --out $tmp/latents --device cuda
    $PY -m scripts.train_world --latents $tmp/latents --out $tmp/world --steps 100000 --seconds 10 --batch 64 --device cuda"
step bench_compile 60 $PY -m scripts.bench_compile --device cuda --frames 16 --mode "bf16 roll" --mode "int8 inplace" \
    --json "$OUT/bench_compile.json"
step bench_frame 100 $PY -m scripts.bench_frame --device cuda --dtype bf16 --frames 16 --prod-layers 16 --sessions 1 4 \
    --paths eager whole roll \
    ${ORIGINAL:+--original "$ORIGINAL"} --json "$OUT/bench_frame.json"
step bench_train 25 $PY -m scripts.bench_train --device cuda --config configs/maze_world_d128.yaml --batch 64 --steps 5
step bench_pipeline 35 $PY -m scripts.bench_pipeline --device cuda --frames 32 --prod-window 60 --prod-frames 16 \
    --json "$OUT/bench_pipeline.json"
stages_check() {  # the plain run's frames against OWL_DECODE=async's and --pp 2's, bit for bit
    set -e
    export OWL_DEVICE=cuda OWL_DTYPE=fp32 OWL_COMPILE=0
    local run="--headless --frames 24"
    $PY -m inference.game_cv $run --out "$tmp/sync.mp4" --save-frames "$tmp/sync.npy"
    OWL_DECODE=async $PY -m inference.game_cv $run --out "$tmp/async.mp4" --save-frames "$tmp/async.npy"
    $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m inference.game_cv $run --pp 2 \
        --out "$tmp/pp2.mp4" --save-frames "$tmp/pp2.npy"
    $PY - "$tmp/sync.npy" "$tmp/async.npy" "$tmp/pp2.npy" <<'COMPARE'
import sys

import numpy as np

sync, differ = np.load(sys.argv[1]), 0
for path in sys.argv[2:]:
    other = np.load(path)
    same = other.shape == sync.shape and np.array_equal(other, sync)
    diff = int(np.abs(sync.astype(int) - other.astype(int)).max()) if other.shape == sync.shape else None
    print(f"{path}: {other.shape}, max diff {diff} ({'bit for bit' if same else 'DIFFERS'})")
    differ += not same
sys.exit(differ)
COMPARE
}
export -f stages_check
export PY tmp
step stages 75 bash -c stages_check

if [ ${#failed[@]} -eq 0 ]; then echo "device_check: all steps passed"; else echo "device_check: FAILED: ${failed[*]}"; exit 1; fi
