#!/usr/bin/env bash
# The whole chain behind checkpoints/maze-world, stage by stage, each stage timed:
#
#     bash scripts/reproduce_world.sh                 # from a fresh clone, after the README's install
#     git diff --stat checkpoints/maze-world          # what came out different from the shipped world
#
# The last stages rewrite checkpoints/maze-world (weights, VAE, clips, sheets, MODEL.md) from what
# this run trained. Stage wall times go to work/chain_times.tsv, with the machine on its first lines
# and the total on its last. Every stage resumes, so a rerun after an interruption carries on
# (a finished stage then takes seconds; its time in the table is that rerun's).
# PIECE_SECONDS=9000 runs the chain in pieces of at most 2.5 hours: when the budget is spent the
# running stage saves where it is and the script exits 75; the same command again is the next piece,
# and the table records each piece's time (scripts/stage_times.sh).
# DEVICE=cuda passes --device cuda to the stages that take it; PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEV=()
if [ -n "${DEVICE:-}" ]; then DEV=(--device "$DEVICE"); fi
DATA=work/data_still+explore_corridor2
LATENTS=work/latents_still+explore_corridor2
VAE=work/vae_decoder/final
LOG=work/chain_times.tsv
mkdir -p work
. scripts/stage_times.sh
start_stage_log "$LOG" "${DEVICE:+--device $DEVICE}"

stage vae_data     $PY -m scripts.generate_data
stage vae          $PY -m scripts.train_vae --steps 5000 "${DEV[@]}"
stage vae_decoder  $PY -m scripts.train_vae --init work/vae/final --decoder-only --out work/vae_decoder --steps 6000 --lr 0.001 "${DEV[@]}"
stage world_data   $PY -m scripts.generate_data --policy still+explore --corridor 2 --out $DATA
stage encode       $PY -m scripts.encode_latents --data $DATA --vae $VAE --out $LATENTS "${DEV[@]}"
stage world        $PY -m scripts.train_world --latents $LATENTS --out work/world_128 --batch 4 --steps 3000 \
                     --config configs/maze_world_d128.yaml --lr 0.001 --target-frac 0.5 --compile "${DEV[@]}"
stage export_base  $PY -m scripts.export_checkpoint --latents $LATENTS --data $DATA --vae $VAE --world work/world_128 --out work/maze-world-128
stage world_ft     $PY -m scripts.train_world --latents $LATENTS --out work/ft128_more --batch 4 --steps 500 \
                     --config configs/maze_world_d128.yaml --lr 0.0003 --ema 0.98 --target-frac 0.5 --init work/maze-world-128 --compile "${DEV[@]}"
stage export_d128  $PY -m scripts.export_checkpoint --latents $LATENTS --data $DATA --vae $VAE --world work/ft128_more --out work/maze-world-d128
stage world_w64    $PY -m scripts.train_world --latents $LATENTS --out work/world_w64 --batch 4 --steps 800 \
                     --config configs/maze_world_d128_w64.yaml --lr 0.0003 --ema 0.98 --target-frac 0.5 --init work/maze-world-d128 \
                     --compile --open-turn-weight 2 "${DEV[@]}"
stage export       $PY -m scripts.export_checkpoint --latents $LATENTS --data $DATA --vae $VAE --world work/world_w64
stage eval         env OWL_DTYPE=fp32 $PY -m scripts.eval_world --checkpoint checkpoints/maze-world --euler-steps 16 --out eval/maze-world
stage model_card   $PY -m scripts.export_checkpoint --latents $LATENTS --data $DATA --vae $VAE --world work/world_w64 --eval eval/maze-world/eval.json

end_stage_log
cp "$LOG" checkpoints/maze-world/chain_times.tsv  # the shipped world keeps the times of the run that made it
cat "$LOG"
