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
#            TOGETHER=1 trains them all at once instead, each on its share of the cores (two
#            trainings sharing one GPU took 5x as long a step as bench_train's step alone: docs/results.md)
#   export   each variant as a checkpoint folder <work>/<name>/checkpoint (weights in files of at
#            most 16 MB, its training record in world_training.json)
# VARIANTS is a space-separated list of NAME:POLICY:CONFIG:OPEN_TURN_WEIGHT; side by side they
# measure what each change buys at one budget. LOOK draws the maze (generate_data --look) and
# TRAIN_FLAGS adds train_world flags to every variant. Evaluate a checkpoint with scripts.eval_world.
# INIT fine-tunes a trained world (a checkpoint folder of the variants' model shape) instead of
# starting from random weights. PIECES trains each variant on in further pieces, each from the one
# before (exported to <work>/<name>/piece<K>), as space-separated SECONDS[:FLAGS] with the piece's own
# train_world flags joined by commas; the shipped world's last stage (from the 32-frame world that
# reproduce_world.sh exports), scaled up, then a self-rollout piece and a plain one:
#     INIT=work/maze-world-d128 VARIANTS="w64o:still+explore:configs/maze_world_d128_w64.yaml:2" LR=0.0003 \
#     TRAIN_FLAGS="--ema 0.98" TRAIN_SECONDS=180 PIECES="120:--self-rollout,6 60" \
#     bash scripts/world_gpu.sh work/gpu
# Each piece compiles again inside its budget (a process of its own); a rerun into the same WORK
# skips the pieces already done and resumes a stopped one.
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
INIT=${INIT:-}  # a checkpoint folder to fine-tune (default: random weights)
PIECES=${PIECES:-}  # further pieces, SECONDS[:FLAGS,...] each
for piece in $PIECES; do
  [[ $piece =~ ^[0-9]+(\.[0-9]+)?(:(--[^,]+(,[^,]+)*)?)?$ ]] && [[ ! $piece =~ ^0+(\.0+)?(:|$) ]] || {
    echo "error: PIECES: '$piece' is not SECONDS[:FLAGS] (seconds > 0, flags joined by commas, e.g. 120:--self-rollout,6)" >&2; exit 2; }
done
if [ -n "$INIT" ] && [ ! -f "$INIT/config.yaml" ]; then
  echo "error: INIT=$INIT is not a checkpoint folder (no config.yaml there); name a trained world, e.g. checkpoints/maze-world" >&2; exit 2
fi
if [ -n "$INIT" ] && [ ! -f "$INIT/world_training.json" ]; then  # the exported model card tells the whole chain
  echo "error: INIT=$INIT has no world_training.json (its training record), so the card of a world trained from it could not say how it was made; name an exported world, e.g. checkpoints/maze-world" >&2; exit 2
fi
case $TOGETHER in 0|1) ;; *) echo "error: TOGETHER=$TOGETHER: use 0 (variants in turn, the default) or 1 (at once)" >&2; exit 2;; esac
for v in $VARIANTS; do
  [[ $v =~ ^[A-Za-z0-9_.+-]+:[a-z+]+:[^:]+:[0-9]+(\.[0-9]+)?$ ]] || {
    echo "error: VARIANTS: '$v' is not NAME:POLICY:CONFIG:OPEN_TURN_WEIGHT (e.g. turns:turns:configs/maze_world_d128.yaml:0)" >&2; exit 2; }
done
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

train_variant() {  # NAME POLICY CONFIG WEIGHT: the first piece, then each of PIECES from the one before
  # A piece already done (exported, or the last one's EMA weights saved) is skipped, and one that was
  # stopped resumes from its saved state, so a rerun of a stopped run carries on where it was.
  local name=$1 policy=$2 config=$3 weight=$4 init=$INIT k=0 piece secs flags out init_next finished rc
  local pieces=("$TRAIN_SECONDS:" $PIECES)
  for piece in "${pieces[@]}"; do
    secs=${piece%%:*} flags=${piece#*:}
    [ "$flags" != "$piece" ] || flags=
    if [ $((k + 1)) -eq ${#pieces[@]} ]; then  # the last piece: the world the export stage exports
      out="$WORK/$name/world" init_next= finished="$out/ema_core.pt"
    else
      out="$WORK/$name/piece$k/world" init_next="$WORK/$name/piece$k/checkpoint"
      finished="$init_next/model.safetensors"
    fi
    if [ -f "$finished" ]; then
      echo "$name: piece $k trained already ($finished)"
    else
      rc=0
      [ -f "$out/ema_core.pt" ] ||  # trained, not yet exported: export it only
        $PY -m scripts.train_world --latents "$WORK/latents_$policy" --out "$out" --config "$config" \
          --batch "$BATCH" --steps 1000000 --seconds "$secs" --lr "$LR" --target-frac 0.5 \
          --open-turn-weight "$weight" --save-every 500 --device "$DEVICE" ${init:+--init "$init"} $COMPILE $PRECISION \
          $TRAIN_FLAGS ${flags//,/ } || rc=$?
      [ $rc -eq 0 ] || return $rc  # 75: stopped by a signal, its state saved
      if [ -n "$init_next" ]; then
        $PY -m scripts.export_checkpoint --latents "$WORK/latents_$policy" --data "$WORK/data_$policy" --vae "$VAE" \
          --world "$out" --out "$init_next" --future "$CLIP_FUTURE" || return 1
      fi
    fi
    init=$init_next
    k=$((k + 1))
  done
}

train() {  # exits 75 (the stage then says how to resume) when a signal stopped a training
  local v n threads rc stopped=0 pid
  n=$(echo $VARIANTS | wc -w) threads=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
  for v in $VARIANTS; do
    mkdir -p "$WORK/$(field "$v" 1)"
    set -- "$(field "$v" 1)" "$(field "$v" 2)" "$(field "$v" 3)" "$(field "$v" 4)"
    if [ "$TOGETHER" = 1 ]; then
      OMP_NUM_THREADS=$threads train_variant "$@" > "$WORK/$1/train.log" 2>&1 &
    else
      rc=0
      train_variant "$@" > "$WORK/$1/train.log" 2>&1 || rc=$?
      [ $rc -ne 75 ] || return 75
      [ $rc -eq 0 ] || echo "$1 failed to train (its train.log says why); the others go on"
    fi
  done
  for pid in $(jobs -p); do
    rc=0
    wait "$pid" || rc=$?
    [ $rc -ne 75 ] || stopped=1
    [ $rc -eq 0 ] || [ $rc -eq 75 ] || echo "a variant failed to train (its train.log says why); the others go on"
  done
  for v in $VARIANTS; do tail -n 2 "$WORK/$(field "$v" 1)/train.log"; done
  [ $stopped -eq 0 ] || return 75
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
