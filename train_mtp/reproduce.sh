#!/usr/bin/env bash
# Reproduces the embedded model and the MTP-head comparison of docs/results.md on one GPU (about 6 minutes on an H200).
#   bash train_mtp/reproduce.sh OUT_DIR
set -euo pipefail
OUT=${1:?usage: reproduce.sh OUT_DIR}
W=${WORK:-/tmp/hcf-train}
DATA=${DATA:-$W/data}  # a corpus built elsewhere (python -m train_mtp.corpus) can be passed in
mkdir -p "$OUT" "$W"
[ -f "$DATA/splits.json" ] || python3 -m train_mtp.corpus --out "$DATA"
python3 -m train_mtp.pretrain --data "$DATA" --workdir "$W/pretrain" --out "$OUT/model" --steps 2000
python3 -m train_mtp.train --base "$OUT/model" --data "$DATA" --depth 5 --mode shared --out "$W/shared-5" \
    --workdir "$W/mtp-shared" --steps 600
python3 -m train_mtp.train --base "$OUT/model" --data "$DATA" --depth 5 --mode independent \
    --out "$W/independent-5" --workdir "$W/mtp-independent" --steps 600
python3 -m train_mtp.evaluate --data "$DATA" --depth 5 --out "$OUT/RESULTS.md" \
    --model "$OUT/model" --label "joint-1 reused" --model "$W/shared-5" --label shared-5 \
    --model "$W/independent-5" --label independent-5 \
    --command "python -m train_mtp.corpus --out DATA   # on CPython 3.12.1 (pyenv), full Lib/ incl. test/" \
    --command "python -m train_mtp.pretrain --data DATA --out hcfjax/assets/stdlib-v3 --steps 2000" \
    --command "python -m train_mtp.train --data DATA --depth 5 --mode shared --out SHARED --steps 600" \
    --command "python -m train_mtp.train --data DATA --depth 5 --mode independent --out INDEP --steps 600" \
    --command "python -m train_mtp.evaluate --data DATA --depth 5 --model hcfjax/assets/stdlib-v3 --model SHARED --model INDEP"
cp "$W/pretrain/loss.png" "$OUT/pretrain_loss.png"
tar czf "$OUT/logs.tgz" -C "$W" pretrain/log.jsonl pretrain/summary.json mtp-shared/log.jsonl mtp-shared/summary.json \
    mtp-independent/log.jsonl mtp-independent/summary.json -C "$DATA" splits.json
