#!/usr/bin/env bash
# Trained worlds from nothing in one command, sized for one GPU machine and one 10-minute run:
#
#     bash scripts/world_gpu.sh work/gpu                     # on a CUDA machine, the defaults below
#     DEVICE=cpu EPISODES=4 FRAMES=48 TRAIN_SECONDS=20 BATCH=2 bash scripts/world_gpu.sh work/tiny   # the same chain, tiny
#
# Stages, each timed into <work>/times.tsv:
#   data     episodes of every policy the variants name, rendered on all cores (generate_data --workers)
#   encode   latents with the shipped autoencoder (checkpoints/maze-world/vae; VAE= another)
#   train    each variant in turn alone on the device, in bf16 with torch.compile, each for the same
#            wall-clock budget (train_world --seconds: the step count that fits, cosine to the end);
#            TOGETHER=1 trains them all at once instead, each on its share of the cores (one GPU
#            shared by two trainings made each step 5x slower than a step alone: docs/results.md)
#   export   each variant as a checkpoint folder <work>/<name>/checkpoint (weights in files of at
#            most 16 MB, its training record in world_training.json)
# VARIANTS is a space-separated list of NAME:POLICY:CONFIG:OPEN_TURN_WEIGHT; side by side they
# measure what each change buys at one budget. LOOK draws the maze (generate_data --look) and
# TRAIN_FLAGS adds train_world flags to every variant. Evaluate a checkpoint with scripts.eval_world.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:?usage: bash scripts/world_gpu.sh WORK_DIR}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
EPISODES=${EPISODES:-768}
FRAMES=${FRAMES:-256}
CORRIDOR=${CORRIDOR:-2}
LOOK=${LOOK:-brick}  # how the maze is drawn (generate_data --look)
TRAIN_FLAGS=${TRAIN_FLAGS:-}  # more train_world flags for every variant, e.g. "--self-rollout 4"
WORKERS=${WORKERS:-$(nproc)}
TRAIN_SECONDS=${TRAIN_SECONDS:-300}
BATCH=${BATCH:-64}
LR=${LR:-0.001}
VAE=${VAE:-checkpoints/maze-world/vae}
CLIP_FUTURE=${CLIP_FUTURE:-1000}  # recorded policy actions after each exported clip's history
VARIANTS=${VARIANTS:-"turns-smooth:turns:configs/maze_world_d128_smooth.yaml:0"}
COMPILE=${COMPILE:---compile}  # COMPILE= trains eager
PRECISION=${PRECISION:-}  # PRECISION=--fp32 on a CPU without fast bf16
TOGETHER=${TOGETHER:-0}  # 1: train the variants at once instead of in turn
case $TOGETHER in 0|1) ;; *) echo "error: TOGETHER=$TOGETHER: use 0 (variants in turn, the default) or 1 (at once)" >&2; exit 2;; esac
mkdir -p "$WORK"
. scripts/stage_times.sh
start_stage_log "$WORK/times.tsv" "--device $DEVICE$($PY -c 'import torch; print(", " + torch.cuda.get_device_name() if torch.cuda.is_available() else "")')"

field() { echo "$1" | cut -d: -f"$2"; }
policies=$(for v in $VARIANTS; do field "$v" 2; done | sort -u)

data() {
  local policy
  for policy in $policies; do
    $PY -m scripts.generate_data --policy "$policy" --corridor "$CORRIDOR" --look "$LOOK" --episodes "$EPISODES" --frames "$FRAMES" \
      --workers "$WORKERS" --out "$WORK/data_$policy"
  done
}

encode() {
  local policy
  for policy in $policies; do
    $PY -m scripts.encode_latents --data "$WORK/data_$policy" --vae "$VAE" --out "$WORK/latents_$policy" --device "$DEVICE" &
  done
  wait_all
}

wait_all() {  # wait for every background job; fail if any failed
  local rc=0 pid
  for pid in $(jobs -p); do wait "$pid" || rc=1; done
  return $rc
}

train() {
  local v name policy config weight n threads
  n=$(echo $VARIANTS | wc -w) threads=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
  for v in $VARIANTS; do
    name=$(field "$v" 1) policy=$(field "$v" 2) config=$(field "$v" 3) weight=$(field "$v" 4)
    mkdir -p "$WORK/$name"
    set -- $PY -m scripts.train_world --latents "$WORK/latents_$policy" --out "$WORK/$name/world" --config "$config" \
      --batch "$BATCH" --steps 1000000 --seconds "$TRAIN_SECONDS" --lr "$LR" --target-frac 0.5 \
      --open-turn-weight "$weight" --save-every 500 --device "$DEVICE" $COMPILE $PRECISION $TRAIN_FLAGS
    if [ "$TOGETHER" = 1 ]; then
      OMP_NUM_THREADS=$threads "$@" > "$WORK/$name/train.log" 2>&1 &
    else
      "$@" > "$WORK/$name/train.log" 2>&1 || echo "$name failed to train (its train.log says why); the others go on"
    fi
  done
  wait_all || echo "some variants failed to train (their train.log says why); the others go on"
  for v in $VARIANTS; do tail -n 2 "$WORK/$(field "$v" 1)/train.log"; done
}

export_all() {
  local v name policy
  for v in $VARIANTS; do
    name=$(field "$v" 1) policy=$(field "$v" 2)
    [ -f "$WORK/$name/world/ema_core.pt" ] || { echo "$name: not trained, not exported"; failed=1; continue; }
    $PY -m scripts.export_checkpoint --latents "$WORK/latents_$policy" --data "$WORK/data_$policy" --vae "$VAE" \
      --world "$WORK/$name/world" --out "$WORK/$name/checkpoint" --future "$CLIP_FUTURE" > "$WORK/$name/export.log" 2>&1 &
  done
  wait_all || { tail -n 30 "$WORK"/*/export.log; return 1; }
}

failed=0

stage data data
stage encode encode
stage train train
stage export export_all
end_stage_log
cat "$WORK/times.tsv"
exit $failed
