#!/usr/bin/env bash
# The GPU bytes of a tree: sha256 of fixed-seed ANDREA-12M checkpoints trained on the device
# (fp32, bf16, fp16; warmup 200 steps then main 100 steps, so a checkpoint resume is inside),
# on the embedded corpus. A refactor of the model must leave every hash the same.
#
#   bash bench/gpu_hashes.sh [TREE] [OUT]      # TREE: the source tree to run (default .)
#                                              # OUT: where runs and hashes go (default $OUT/gpu_hashes)
# (a PYTHONPATH already set is kept after TREE: e.g. a folder with jsonschema for a bare device)
#
# The data (tokenizer + token shards, 12M shapes: V = 4353) is built by the andrea CLI of TREE
# from data/embedded with small -S overrides so it takes seconds; it is CPU work and the same
# for every tree. Prints "<sha256>  <precision>/<file>" lines and writes them to OUT/hashes.txt.
set -euo pipefail
TREE=$(cd "${1:-.}" && pwd)
DEST=${2:-${OUT:-/tmp}/gpu_hashes}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
W=$(mktemp -d)
cd "$TREE"
export PYTHONPATH=$TREE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
A="python3 -m andrea.cli"
$A pull-hermes3 -S hermes3.source=embedded --embedded data/embedded --out "$W/raw" > "$DEST/data.log" 2>&1
$A prep-megachat -S hermes3.source=embedded --raw "$W/raw" --embedded data/embedded --out "$W/megachat" >> "$DEST/data.log" 2>&1
$A tokenizer --profile andrea-12m -S tokenizer.max_train_bytes=3000000 --train "$W/megachat/train.parquet" \
   --out "$W/tok" >> "$DEST/data.log" 2>&1
$A diet-alignment --profile andrea-12m -S 'diet.sweep=[2048,4096]' -S diet.max_sample_bytes=1000000 \
   --tokenizer "$W/tok/tokenizer.json" --megachat "$W/megachat" --tokens "$W/tokens" --report "$W/rep" \
   >> "$DEST/data.log" 2>&1
S=(-S train.backend=cupy -S train.max_steps=300 -S curriculum.warmup_steps=200 -S train.eval_every=100
   -S train.eval_batches=2 -S train.log_every=50 -S train.checkpoint_every=1000 -S coherence.every=150
   -S coherence.max_new_tokens=32)
: > "$DEST/hashes.txt"
for p in fp32 bf16 fp16; do
  R="$DEST/run-$p"
  rm -rf "$R"
  $A train --phase warmup --profile andrea-12m "${S[@]}" -S train.precision=$p --tokenizer "$W/tok/tokenizer.json" \
     --tokens "$W/tokens" --out "$R/warmup" > "$DEST/train-$p.log" 2>&1
  $A train --phase main --profile andrea-12m "${S[@]}" -S train.precision=$p --tokenizer "$W/tok/tokenizer.json" \
     --tokens "$W/tokens" --init "$R/warmup" --out "$R/main" >> "$DEST/train-$p.log" 2>&1
  (cd "$DEST" && sha256sum "run-$p/warmup/model.bin" "run-$p/main/model.bin" "run-$p/main/model.samples.json") \
     | tee -a "$DEST/hashes.txt"
done
sha256sum "$W/tok/tokenizer.json" | sed "s#$W/##" | tee -a "$DEST/hashes.txt"
rm -rf "$W"
