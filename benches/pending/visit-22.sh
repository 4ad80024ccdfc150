#!/usr/bin/env bash
# Pending visit (written in the twenty-second session, when no GPU was lent; not yet run).
#
# Part 1, issue #8. What it measures: decode attention with each sequence's heads as two blocks over all of its keys
# (`set_head_halves_max_tiles`: "di_attn_decode_hs", the new kernel with S and P V transposed so
# that 32 heads fill a wgmma; and "+halves", di_attn_decode_sp with kernel flag kFlagHeadHalves and
# half of each S wgmma idle) against
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
# - di_attn_decode_hs (written blind: the GPU tests check it against the CPU first; if they fail,
#   the tests.log says where): no merge, no idle half of M, 2.5 key stages. Its two blocks of a
#   sequence read the same rows, so L2 -> SM traffic doubles (the DRAM reads should not). Predicted
#   ahead of the two-split default everywhere: +30-60% at 2-6 tiles, CSA 0.46 -> 0.55-0.65 and HCA
#   128k 0.50 -> 0.55-0.65 on the H200 if L2 serves the second read at ~6 TB/s.
# If so, the default becomes `set_head_halves_max_tiles(u32::MAX)` on hs (or up to the measured
# crossover).
# Also "/shalf" rows (`set_s_half_first`): the S warpgroup starts S on a tile's dims 0..255 before
# dims 256..511 have landed. Predicted +1-3% for the S-warpgroup kernels (the last tile's chain
# shortens by ~half of S, ~500 cycles; each stage is freed that much sooner), nothing elsewhere.
# The decode test checks that it gives the same bits.
#
# Part 2, issue #7: the FP8 decode GEMMs on x already quantised ("/fp8x": `gemm_fp8_act` with
# `set_fp8_dec_act`, the decode kernel copying the e4m3 codes and scales in instead of rounding bf16
# x after its wait; "/fp8x/requant": the route before, x dequantised for gemm_lowp), beside the
# default rows (bf16 x), at m = 1, 4, 16 for every FP8 weight. gpu_parity's
# gpu_gemm_fp8_act_matches_gemm_lowp checks the same bits both ways.
# Predicted: /fp8x against the bf16-x row of the same weight and m, GPU-queued: wq_b +3-8% at m = 16
# (the x rounding, ~85 instructions an x block, and half the x bytes leave the path from the wait
# to the first MMA: 0.654 -> ~0.70 on the H200), +0-3% at m = 1 and 4; the k-split W (wo_b, w1,
# w13, wq_a) +2-6% at 4 and 16 tokens; /fp8x/requant behind both (a second launch). If so, the
# switch goes on by default, and the engine's norms should write FP8 x.
# Also "attn.wq_a+wkv" rows: the two projections of the same x stacked as one [1536, 4096] FP8
# weight (6.3 MB). Predicted ~0.28-0.35 at m = 1 (between wq_a's 0.19 at 4.2 MB and w13's 0.48 at
# 16.8 MB), where wq_a and wkv apart pay two launches.
# Also "norm-fp8" rows: `rms_norm_fp8` (RMSNorm and the FP8 quantisation in one pass, what such a
# norm would run) against rms_norm + quantize_act_fp8. Predicted: 1.5-2x at 16384 rows (x read once,
# no bf16 written and read back), ~2x at 1-64 rows (one launch instead of two); gpu_parity's
# gpu_rms_norm_fp8_matches_quantised_rms_norm checks it.
#
# Build (this machine): cargo xtask kernels && cargo xtask gpu-bundle --only gpu_attention,gpu_parity,gpu_moe,gpu_ops
#   cp benches/pending/visit-22.sh target/gpu-bundle/go.sh
# Device call: carry ["target/gpu-bundle"], command `bash target/gpu-bundle/go.sh "$OUT" "tests attn"`
#   then `... "$OUT" ops` (the three
#   large model files moved out of the tree first: the tree and the bundle must stay under 64 MiB).
# Parts: go.sh OUT [PARTS] with PARTS any of "tests attn ops" (the default: all three, ~7-9 minutes
# when nothing hangs; a hang costs its part's limit, so on a first run take "tests attn" and then
# "ops" as two calls).
set -u
out=${1:?}
parts=${2:-tests attn ops}
want() { case " $parts " in *" $1 "*) return 0;; *) return 1;; esac; }
d=$(cd "$(dirname "$0")" && pwd)
here=$(mktemp -d)
r=$(mktemp -d)
. "$d/bundle.sh"
unpack_bundle "$d" "$here"
save() { tar czf "$out/visit.tgz" -C "$r" .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$r/doctor.txt" 2>&1
cat "$r/doctor.txt"
# The new kernels' tests first, with short limits (a kernel that deadlocks hangs until killed):
# if the attention tests fail or hang, the bench runs without the head-halves rows.
want tests && for t in "$here"/tests/*; do
  SECONDS=0
  n=$(basename "$t")
  timeout 150 "$t" --test-threads 1 --nocapture > "$r/tests-$n.log" 2>&1; rc=$?; echo "exit $rc" >> "$r/tests-$n.log"
  echo "== $n ${SECONDS}s rc $rc"; grep -E "^test |test result|panicked|^exit" "$r/tests-$n.log" | cut -c1-200
  case "$n" in *gpu_attention*) [ $rc -ne 0 ] && export DEEPINFER_ATTN_NO_HALVES=1 && echo "no halves rows";; esac
  save
done
want attn && for n in 1 2; do
  SECONDS=0
  DEEPINFER_BENCH_ONLY="attention_decode" DEEPINFER_BENCH_JSON="$r/bench-r$n.json" timeout 150 \
    "$here/benches/deepinfer-kernels-ffi-gpu_attention" --bench > "$r/bench-r$n.log" 2>&1
  echo "== bench r$n ${SECONDS}s"
  grep -o "attention_decode.*" "$r/bench-r$n.log" | grep -v "f32merge\|gather\|nopdl\|di_attn_decode  " \
    | sed -E 's/.*(di_attn_decode_[a-z0-9_+]+) +([A-Za-z]+ [^ ]+).*achieved.floor ([0-9.]+).*graph ([0-9.]+) ms +([0-9.]+).*/\1 \2 \3 graph \5/'
  save
done
if want ops; then
  SECONDS=0
  DEEPINFER_BENCH_ONLY="gemm attn.,gemm shared_experts.,norm-fp8" DEEPINFER_BENCH_JSON="$r/ops.json" timeout 240 \
    "$here/benches/deepinfer-kernels-ffi-gpu_ops" --bench > "$r/ops.log" 2>&1
  echo "== gpu_ops ${SECONDS}s"
  grep -E "^gemm " "$r/ops.log" | sed 's/Fp8Block128//; s/ median.*GPU-queued/ q/; s/without PDL[^;]*;//; s/|.*//' | cut -c1-150
  save
fi
echo done
