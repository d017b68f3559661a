#!/usr/bin/env bash
# The bandit sweep of issue 14 ("no source left behind") on one GPU: ucb1 variants against
# uniform at the 12M shapes, 3000 steps (1000 warmup), bf16, embedded corpus, through
# bench/curriculum_compare.py, within one device call of ~6 minutes.
#
#   bash bench/bandit_sweep.sh TOKDIR OUTDIR [BUDGET_S]
#     TOKDIR: holds tokenizer/tokenizer.json and tokens/{train,val}/*.bin for profile andrea-12m
#             (built on the CPU: andrea tokenizer / diet-alignment --profile andrea-12m
#             -S hermes3.source=embedded -S train.backend=numpy, seconds)
#     OUTDIR: stage1.{md,json}, final.{md,json} and runs.tgz (logs, loss histories); the runs stay in /tmp
#
# Ran once on the H200 (device call of 258 s: stage 1 took 175 s for 8 runs at once, stage 2
# then had time for one variant); the figures are in docs/FIREHOSE-BANDIT.md, "Measured".
# That run wrote every log under OUTDIR and lost all but 8 files (the device returns at most
# 8): this version packs them into runs.tgz.
#
# Stage 1: every variant below and uniform, seed 1337, all at once. Stage 2: uniform and the
# variants stage 1 ranks best (by pick_best below), seeds 1 and 2, as many as the time left
# allows; then one 3-seed table of those. Each stage's compare.{json,md} is kept.
set -uo pipefail
TOK=$1
DEST=$2
BUDGET=${3:-340}
T0=$(date +%s)
RUNS=${SWEEP_RUNS:-/tmp/bandit_sweep}
mkdir -p "$DEST" "$RUNS"
elapsed() { echo $(( $(date +%s) - T0 )); }
# SWEEP_SETS / SWEEP_PROFILE replace the shapes for a dry run on the CPU (tests of this script only)
read -r -a SETS <<< "${SWEEP_SETS:--S train.backend=cupy -S train.precision=bf16 -S train.max_steps=3000 -S curriculum.warmup_steps=1000 -S train.eval_every=100}"
COMMON=(--profile "${SWEEP_PROFILE:-andrea-12m}" --params params.yaml --tokenizer "$TOK/tokenizer/tokenizer.json"
        --tokens "$TOK/tokens" --out "$RUNS" --threads 1 --no-rescore "${SETS[@]}")
U=bandit.policy=ucb1
VARIANTS=(
  "ucb1-old=$U,bandit.epoch_penalty=tokens,bandit.floor=0.02,bandit.reward=progress"
  "ep-none=$U,bandit.epoch_penalty=none,bandit.floor=0.02,bandit.reward=progress"
  "ep-excess=$U,bandit.epoch_penalty=excess,bandit.floor=0.02,bandit.reward=progress"
  "ex-f10=$U,bandit.epoch_penalty=excess,bandit.floor=0.1,bandit.reward=progress"
  "ex-f10-rel=$U,bandit.epoch_penalty=excess,bandit.floor=0.1,bandit.reward=relative"
  "ex-f10-d1=$U,bandit.epoch_penalty=excess,bandit.floor=0.1,bandit.reward=progress,bandit.dice_warmup=1,bandit.dice_main=1"
  "ex-f11-rel-d1=$U,bandit.epoch_penalty=excess,bandit.floor=0.11,bandit.reward=relative,bandit.dice_warmup=1,bandit.dice_main=1"
)
VA=()
for v in "${VARIANTS[@]}"; do VA+=(--variant "$v"); done
echo "stage 1 at $(elapsed)s: ${#VARIANTS[@]} variants + uniform, seed 1337"
timeout $(( BUDGET - $(elapsed) )) python3 bench/curriculum_compare.py "${COMMON[@]}" --seeds 1337 --jobs 8 "${VA[@]}" \
  > "$RUNS/stage1.log" 2>&1
rc=$?
cp "$RUNS"/compare.md "$DEST/stage1.md" 2>/dev/null; cp "$RUNS"/compare.json "$DEST/stage1.json" 2>/dev/null
T1=$(elapsed)
echo "stage 1 rc=$rc done at ${T1}s"
if [ $rc -eq 0 ]; then
  LEFT=$(( BUDGET - T1 - 15 ))          # stage 2 may take (its runs / stage 1's runs) x stage 1's wall, +15%
  K=0; [ $LEFT -gt $(( T1 * 6 * 115 / 800 )) ] && K=2; [ $K -eq 0 ] && [ $LEFT -gt $(( T1 * 4 * 115 / 800 )) ] && K=1
  echo "stage 2: ${LEFT}s left, stage-1 wall ${T1}s -> $K variants"
  if [ $K -gt 0 ]; then
    mapfile -t BEST < <(python3 - "$DEST/stage1.json" $K <<'EOF'
import json, sys
f = json.load(open(sys.argv[1]))["figures"]
def bad(x):  # how far from the targets: overall <= 0.95, worst source <= 1.05
    return max(x["overall_ratio"] / 0.95, x["worst_source_ratio"] / 1.05)
for name in sorted(f, key=lambda n: (bad(f[n]), f[n]["overall_ratio"]))[:int(sys.argv[2])]:
    print(name)
EOF
)
    V2=()
    for v in "${VARIANTS[@]}"; do for b in "${BEST[@]}"; do [ "${v%%=*}" = "$b" ] && V2+=(--variant "$v"); done; done
    echo "stage 2 variants: ${BEST[*]}"
    timeout $(( BUDGET - $(elapsed) )) python3 bench/curriculum_compare.py "${COMMON[@]}" --seeds 1,2 --jobs 8 "${V2[@]}" \
      > "$RUNS/stage2.log" 2>&1 && \
    python3 bench/curriculum_compare.py "${COMMON[@]}" --seeds 1337,1,2 --eval-only "${V2[@]}" \
      > "$RUNS/final.log" 2>&1
    cp "$RUNS"/compare.md "$DEST/final.md" 2>/dev/null; cp "$RUNS"/compare.json "$DEST/final.json" 2>/dev/null
  fi
fi
echo "done at $(elapsed)s"
# the device returns at most 8 files: the tables above (<= 6) and one archive of every log,
# compare.json and loss history (the runs' weights stay behind)
tar czf "$DEST/runs.tgz" -C "$RUNS" $(cd "$RUNS" && ls -d *.log compare.* */*/model.loss.json */*/model.state.json 2>/dev/null) \
  2>/dev/null
exit 0
