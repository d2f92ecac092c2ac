set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python -m pallas_kernels.bench.moe --kernel-time --rounds 3 --cases 16x128x7168x2048,16x128x2048x7168,32x1024x7168x2048,32x1024x2048x7168 --time-limit 200 --hard-limit 260 2>&1 | tee $OUT/moe.log | tail -60
for g in off on; do python -m hcfjax.bench.generate --scheme w4a8 --batches 1,32,128 --grouped-down-input $g 2>&1 | tee $OUT/gen_$g.log | tail -14; done
