# Sourced by the chain scripts (reproduce_world.sh, world_gpu.sh): a table of each stage's wall time.
#   start_stage_log FILE [NOTE]   the machine (CPU, threads, torch, NOTE), the start time, the header
#   stage NAME COMMAND...         run COMMAND, then append NAME and its seconds
#   end_stage_log                 append the total
# PY names the interpreter.

start_stage_log() {
  STAGE_LOG=$1
  {
    echo -e "# machine\t$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1), $(nproc) threads, torch $($PY -c 'import torch; print(torch.__version__)')${2:+, $2}"
    echo -e "# started\t$(date -u +%FT%TZ)"
    echo -e "stage\tseconds"
  } > "$STAGE_LOG"
  STAGE_START=$(date +%s)
}

stage() {
  local name=$1 t0
  shift
  echo "== $name: $*"
  t0=$(date +%s)
  "$@"
  echo -e "$name\t$(( $(date +%s) - t0 ))" >> "$STAGE_LOG"
}

end_stage_log() {
  echo -e "total\t$(( $(date +%s) - STAGE_START ))" >> "$STAGE_LOG"
}
