#!/usr/bin/env bash
# Pending visit (twentieth session; the device was refused after the first visit). Measures:
# (1) narrow W at 9 and 16 tokens on the decode kernel's split form (dec_plan's default since
#     the x rounding by bits) against the mma.sync kernels, every FP8 decode shape (the bench runs
#     both; outputs checked against the CPU);
# (2) gpu_parity and gpu_moe tests (the plan at 9-16 tokens; the settled down GEMM on by default);
# (3) the MoE bench at one token, three builds alternating, two rounds: the FP4 decode kernel's
#     scales read a pair ahead with the item's scale rows prefetched into L2 (this build, B), read
#     a pair ahead only (gpu_moe-C: the prefetch_l2 loop removed), read where used (14f721c,
#     gpu_moe-before). Gate/up lost ~5% and the down GEMM gained with B
#     (benches/results/2026-12-05-decode-x-rounding): which half costs gate/up.
# Build (model.safetensors moved out of the tree for the device call):
#   git checkout 14f721c -- kernels && cargo xtask kernels && cargo xtask gpu-bundle --only gpu_moe
#   cp target/gpu-bundle/benches/deepinfer-moe-gpu_moe.xz /tmp/gpu_moe-before.xz; git checkout HEAD -- kernels
#   (delete fp4q_wg_body's prefetch_l2 loop) cargo xtask kernels && cargo xtask gpu-bundle --only gpu_moe
#   cp target/gpu-bundle/benches/deepinfer-moe-gpu_moe.xz /tmp/gpu_moe-C.xz; git checkout HEAD -- kernels
#   cargo xtask kernels && cargo xtask gpu-bundle --only gpu_ops,gpu_parity,gpu_moe
#   cp /tmp/gpu_moe-before.xz /tmp/gpu_moe-C.xz target/gpu-bundle/benches/
#   cp benches/pending/fp4-scale-variants.sh target/gpu-bundle/go2.sh
# Run (device tool, carry target/gpu-bundle): bash target/gpu-bundle/go2.sh "$OUT"; files in $OUT/visit2.tgz.
set -u
out=${1:?}
part=${2:-all}
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
export DEEPINFER_REQUIRE_GPU=1
save() { tar czf "$out/visit2.tgz" -C "$r" .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$r/doctor.txt" 2>&1
SECONDS=0
DEEPINFER_GEMM_M=9,16 DEEPINFER_BENCH_ONLY="gemm attn.wq_a m=,gemm attn.wo_b m=,gemm shared_experts.w1 m=,gemm shared_experts.w13 m=" DEEPINFER_BENCH_JSON="$r/ops-narrow.json" timeout 150 "$here/benches/deepinfer-kernels-ffi-gpu_ops" --bench > "$r/ops-narrow.log" 2>&1
echo "== narrow m=9,16 (${SECONDS}s)"; grep -E "^gemm" "$r/ops-narrow.log" | cut -c1-75,150-230
save
SECONDS=0; ( timeout 150 "$here/tests/deepinfer-kernels-ffi-gpu_parity" --test-threads 1 2>&1 | cut -c1-300 > "$r/gpu_parity-tests.log" ); echo "parity ${SECONDS}s"; tail -3 "$r/gpu_parity-tests.log"
SECONDS=0; ( timeout 150 "$here/tests/deepinfer-moe-gpu_moe" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$r/gpu_moe-tests.log" ); echo "moe tests ${SECONDS}s"; tail -3 "$r/gpu_moe-tests.log"
save
for n in 1 2; do
  for b in B C before; do
    bin="$here/benches/deepinfer-moe-gpu_moe"; [ $b != B ] && bin="$here/benches/gpu_moe-$b"
    SECONDS=0
    DEEPINFER_MOE_TOKENS=1 DEEPINFER_BENCH_JSON="$r/moe-1-$b-r$n.json" timeout 60 "$bin" --bench > "$r/moe-1-$b-r$n.log" 2>&1
    echo "== moe 1 $b r$n ${SECONDS}s"; grep -E "GPU-queued|moe layer" "$r/moe-1-$b-r$n.log" | grep -v "_pre_" | cut -c1-160
    save
  done
done
echo done
