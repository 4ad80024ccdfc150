#!/usr/bin/env bash
# Pending visit (written in the twenty-second session, when no GPU was lent; not yet run).
#
# What it measures: decode attention with each sequence's heads as two blocks over all of its keys
# ("+halves": `set_head_halves_max_tiles`, kernel flag kFlagHeadHalves on di_attn_decode_sp) against
# the default two key splits merged in a cluster, at batch 64 for 2, 3, 4, 6, 10 and 18 key tiles,
# two rounds; and the GPU tests that the last two sessions' changes have not yet passed on a GPU:
# gpu_attention (f62780a's run_chained refactor, the halves checks in the decode and paged tests),
# gpu_parity and gpu_moe (a final check of the tree).
#
# Predictions (written before any run; H200 graph column; H100 figures lower, floors at 4.3 TB/s):
# - 2 and 3 tiles (sliding-only, HCA 8k): halves ahead by 20-50% (no cluster merge, ~3.5-4.3 us of
#   a ~13-17 us call; every SM busy where one split left half of them idle); the merge-free one-split
#   kernel was even with two splits there (2026-12-01-attention-merge-ab), since it used 64 SMs.
# - 4-6 tiles: about even (the S warpgroup's chain, ~2000+ cycles a tile with half of M idle,
#   against the merge it saves).
# - 10 and 18 tiles (CSA, HCA 128k): halves behind (S-bound like one split: 0.31 against 0.46-0.52).
# If so, the default becomes `set_head_halves_max_tiles(3)` (or the measured crossover).
# Also "/shalf" rows (`set_s_half_first`): the S warpgroup starts S on a tile's dims 0..255 before
# dims 256..511 have landed. Predicted +1-3% for the S-warpgroup kernels (the last tile's chain
# shortens by ~half of S, ~500 cycles; each stage is freed that much sooner), nothing elsewhere.
# The decode test checks that it gives the same bits.
#
# Build (this machine): cargo xtask kernels && cargo xtask gpu-bundle --only gpu_attention,gpu_parity,gpu_moe
#   cp benches/pending/attention-head-halves.sh target/gpu-bundle/go.sh
# Device call: carry ["target/gpu-bundle"], command `bash target/gpu-bundle/go.sh "$OUT"` (the three
#   large model files moved out of the tree first: the tree and the bundle must stay under 64 MiB).
set -u
out=${1:?}
d=$(cd "$(dirname "$0")" && pwd)
here=$(mktemp -d)
r=$(mktemp -d)
python3 - "$d" "$here" <<'PY'
import lzma, os, sys
src, dst = sys.argv[1], sys.argv[2]
for sub in ("tests", "benches"):
    os.makedirs(os.path.join(dst, sub), exist_ok=True)
    for f in os.listdir(os.path.join(src, sub)):
        if f.endswith(".xz"):
            o = os.path.join(dst, sub, f[:-3])
            with lzma.open(os.path.join(src, sub, f)) as i, open(o, "wb") as w:
                w.write(i.read())
            os.chmod(o, 0o755)
PY
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
export DEEPINFER_REQUIRE_GPU=1
save() { tar czf "$out/visit.tgz" -C "$r" .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$r/doctor.txt" 2>&1
cat "$r/doctor.txt"
for t in "$here"/tests/*; do
  SECONDS=0
  n=$(basename "$t")
  timeout 300 "$t" --test-threads 1 --nocapture > "$r/tests-$n.log" 2>&1; echo "exit $?" >> "$r/tests-$n.log"
  echo "== $n ${SECONDS}s"; grep -E "^test |test result|panicked|^exit" "$r/tests-$n.log" | cut -c1-200
  save
done
for n in 1 2; do
  SECONDS=0
  DEEPINFER_BENCH_ONLY="attention_decode" DEEPINFER_BENCH_JSON="$r/bench-r$n.json" timeout 200 \
    "$here/benches/deepinfer-kernels-ffi-gpu_attention" --bench > "$r/bench-r$n.log" 2>&1
  echo "== bench r$n ${SECONDS}s"
  grep -o "attention_decode.*" "$r/bench-r$n.log" | grep -v "f32merge\|gather\|nopdl\|di_attn_decode  " \
    | sed -E 's/.*(di_attn_decode_[a-z0-9_+]+) +([A-Za-z]+ [^ ]+).*achieved.floor ([0-9.]+).*graph ([0-9.]+) ms +([0-9.]+).*/\1 \2 \3 graph \5/'
  save
done
echo done
