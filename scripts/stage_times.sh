# Sourced by the chain scripts (reproduce_world.sh, world_gpu.sh): a table of each stage's wall time,
# kept over the pieces a chain may run in.
#   start_stage_log FILE [NOTE]   the machine (CPU, threads, torch, NOTE), the start time, the header;
#                                 when FILE holds a chain that stopped at its budget, the next piece of it
#   stage NAME COMMAND...         run COMMAND, then append NAME, its seconds and the piece
#   end_stage_log                 append the total of every piece's stages
# PY names the interpreter. PIECE_SECONDS, when set, is this piece's time budget: a stage still running
# when it is spent gets SIGINT (the training stages finish their step, save their state and stop; the
# file stages keep every finished file), the piece's time is recorded and the script exits with 75.
# Running it again resumes the chain exactly where it stopped, as the next piece. A stage stopped
# by a signal without a budget (it exits 75 once saved) ends the piece the same way.

start_stage_log() {
  STAGE_LOG=$1
  if [ -f "$STAGE_LOG" ] && grep -q '^# piece' "$STAGE_LOG" && ! grep -q '^total' "$STAGE_LOG"; then
    PIECE=$(( $(grep -c '^# piece [0-9]* started' "$STAGE_LOG") + 1 ))
  else
    PIECE=1
    {
      echo -e "# machine\t$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) threads, torch $($PY -c 'import torch; print(torch.__version__)')${2:+, $2}"
      echo -e "# started\t$(date -u +%FT%TZ)"
      echo -e "stage\tseconds\tpiece"
    } > "$STAGE_LOG"
  fi
  echo -e "# piece $PIECE started\t$(date -u +%FT%TZ)" >> "$STAGE_LOG"
  PIECE_START=$(date +%s)
}

end_piece() {
  echo -e "# piece $PIECE took\t$(( $(date +%s) - PIECE_START ))" >> "$STAGE_LOG"
}

stage() {
  local name=$1 t0 rc=0 left
  shift
  if [ -n "${PIECE_SECONDS:-}" ]; then
    left=$(( PIECE_SECONDS - ($(date +%s) - PIECE_START) ))
    if [ "$left" -le 0 ]; then
      end_piece
      echo "== the piece's budget of ${PIECE_SECONDS}s is spent before $name; run the same command again to resume" >&2
      exit 75
    fi
    echo "== $name: $* (${left}s of the piece left)"
    t0=$(date +%s)
    timeout --signal=INT --kill-after=600 "$left" "$@" || rc=$?
  else
    echo "== $name: $*"
    t0=$(date +%s)
    "$@" || rc=$?
  fi
  if [ "$rc" -eq 0 ]; then
    echo -e "$name\t$(( $(date +%s) - t0 ))\t$PIECE" >> "$STAGE_LOG"
  elif [ "$rc" -eq 75 ] || { [ -n "${PIECE_SECONDS:-}" ] && [ "$rc" -eq 124 ]; }; then
    echo -e "$name\t$(( $(date +%s) - t0 ))\t$PIECE\tstopped" >> "$STAGE_LOG"
    end_piece
    if [ "$rc" -eq 124 ]; then  # timeout's status: the budget ran out (whatever the stage exited with)
      echo "== the piece's budget of ${PIECE_SECONDS}s ran out in $name, which saved where it was; run the same command again to resume" >&2
    else  # a signal (Ctrl-C, SIGTERM) stopped a stage that saves, within the budget or without one: the piece ends here too
      echo "== $name was stopped and saved where it was; run the same command again to resume" >&2
    fi
    exit 75
  else
    echo "== $name failed (exit $rc)" >&2
    exit "$rc"
  fi
}

end_stage_log() {
  end_piece
  echo -e "total\t$(awk -F'\t' 'NR > 3 && $1 !~ /^#/ {s += $2} END {print s}' "$STAGE_LOG")" >> "$STAGE_LOG"
}
