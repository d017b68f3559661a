#!/usr/bin/env bash
# One device call of bench/engine_gpu.py runs, inside the call's time limit, with everything brought back as
# ONE tarball in $OUT (the device tool returns at most 8 files a call). Run on the device machine, from the
# repository root, with .whl carried (bench/carry_wheels.sh made it here):
#
#   bash bench/device_queue.sh TAG DEADLINE_S JOB...      # JOB = VARIANT:BATCH@NAME, e.g. andrea-480m:8@m8r1
#   bash bench/device_queue.sh c1 570 andrea-12m:64@b64r1 andrea-480m:8@m8r1
#
# - with REQUIRE_CARD set (a part of the card's name, e.g. H200), stops at once on any other card, before
#   anything is installed or run: a call that asked for a card and got another costs only the machine's start;
# - installs the carried wheels (cuDNN's frontend; jsonschema where the image lacks it) under /tmp;
# - prints the card, driver, power limit, maximum SM clock, torch and CuPy;
# - runs each job as `engine_gpu.py --variants VARIANT:BATCH --precision bf16 --autotune-seed --power
#   --steps 10 --warmup 3` (all three compile modes: its default anchors), stopped by `timeout` at DEADLINE_S
#   seconds from the start of this script; a job that would get under MIN_JOB_S (default 50) is skipped;
#   extra engine_gpu arguments go in $ENGINE_GPU_ARGS;
# - keeps the machine's inductor tuning for the next machine of its card (bench/inductor_seed.py keep);
# - writes $OUT/TAG.tgz: each job's NAME.json and NAME.log, and kept/ (copy it to docs/bench/sNN_*).
# Inductor's cache is .cache/inductor in the repository (ignored; a warm machine keeps it between calls).
set -u
tag=$1 deadline=$2
shift 2
t0=$(date +%s)
work=${QUEUE_DIR:-/tmp/queue}/$tag
mkdir -p "$work"
card=$(nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader | head -1)
if [ -n "${REQUIRE_CARD:-}" ] && [[ "${card%%,*}" != *"$REQUIRE_CARD"* ]]; then
  echo "$card is not the card REQUIRE_CARD names ($REQUIRE_CARD): nothing run"
  exit 0
fi
pip install -q --no-deps --target /tmp/cfe .whl/nvidia_cudnn_frontend-*.whl 2>&1 | grep -v WARNING
python3 -c "import jsonschema" 2>/dev/null || pip install -q --no-deps --target /tmp/deps .whl/deps/*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/cfe:/tmp/deps:. TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
echo "$card"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
for job in "$@"; do
  shapes=${job%@*} name=${job#*@}
  left=$(( deadline - ($(date +%s) - t0) ))
  if [ "$left" -lt "${MIN_JOB_S:-50}" ]; then echo "$name: skipped, ${left}s left"; continue; fi
  # shellcheck disable=SC2086  # ENGINE_GPU_ARGS is a list of words
  timeout "$left" python3 -u bench/engine_gpu.py --variants "$shapes" --precision bf16 --autotune-seed --power \
      --steps 10 --warmup 3 --json "$work/$name.json" ${ENGINE_GPU_ARGS:-} > "$work/$name.log" 2>&1
  echo "$name: rc=$? at $(( $(date +%s) - t0 ))s"
  grep -E "best=" "$work/$name.log" | tail -2
done
python3 bench/inductor_seed.py keep "$work/kept" 2>&1 | tail -3
tar czf "$OUT/$tag.tgz" -C "$work" .
ls -l "$OUT"
