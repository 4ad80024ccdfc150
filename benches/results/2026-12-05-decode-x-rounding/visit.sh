#!/usr/bin/env bash
# Pending visit (nineteenth and twentieth sessions; no device was lent). Measures:
# (1) the FP8 decode GEMM wq_b at m = 1,2,4,8,9,12,16: the x rounding by bits (177abbe) against
#     a6c05f6's kernels (gpu_ops-before), alternating, two rounds;
# (2) narrow W at 16 tokens on the decode kernel (forced per, 596ad77) against the mma.sync kernel;
# (3) gpu_parity and gpu_moe tests (the new rounding; the settled down GEMM of 2c5c1a2; the FP4
#     decode kernel's scales read a pair ahead; gate/up prefetching the down weights into L2);
# (4) the MoE bench (settled down GEMM off/on in one binary) at 1 token, alternating with
#     14f721c's build (gpu_moe-before: the FP4 decode kernel's scales read where used), two
#     rounds (the after build also times gate/up + down pairs and the layer with gate/up
#     prefetching the down weights into L2), then 16/64 tokens.
# Part "ops" is (1)-(2), part "moe" (3)-(4), "all" both (each part fits a device call).
# Build (model.safetensors moved out of the tree for the device call):
#   git checkout a6c05f6 -- kernels/cuda && cargo xtask kernels && cargo xtask gpu-bundle --only gpu_ops
#   cp target/gpu-bundle/benches/deepinfer-kernels-ffi-gpu_ops.xz /tmp/gpu_ops-before.xz
#   git checkout 14f721c -- kernels && cargo xtask kernels && cargo xtask gpu-bundle --only gpu_moe
#   cp target/gpu-bundle/benches/deepinfer-moe-gpu_moe.xz /tmp/gpu_moe-before.xz
#   git checkout HEAD -- kernels && cargo xtask kernels && cargo xtask gpu-bundle --only gpu_ops,gpu_parity,gpu_moe
#   cp /tmp/gpu_ops-before.xz /tmp/gpu_moe-before.xz target/gpu-bundle/benches/
#   cp benches/pending/decode-x-rounding.sh target/gpu-bundle/go.sh
# Run (device tool, carry target/gpu-bundle): bash target/gpu-bundle/go.sh "$OUT" ops, then
# bash target/gpu-bundle/go.sh "$OUT" moe; each part's files land in $OUT/visit-<part>.tgz.
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
save() { tar czf "$out/visit-$part.tgz" -C "$r" .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$r/doctor.txt" 2>&1
if [ "$part" != moe ]; then
for n in 1 2; do
  for b in after before; do
    bin="$here/benches/deepinfer-kernels-ffi-gpu_ops"; [ $b = before ] && bin="$here/benches/gpu_ops-before"
    SECONDS=0
    DEEPINFER_GEMM_M=1,2,4,8,9,12,16 DEEPINFER_BENCH_ONLY="gemm attn.wq_b m=" DEEPINFER_BENCH_JSON="$r/ops-wqb-$b-r$n.json" timeout 120 "$bin" --bench > "$r/ops-wqb-$b-r$n.log" 2>&1
    echo "== $b r$n (${SECONDS}s)"; grep -E "di_gemm_fp8_dec" "$r/ops-wqb-$b-r$n.log" | cut -c1-60,150-230
  done
done
save
SECONDS=0
DEEPINFER_GEMM_M=16 DEEPINFER_BENCH_ONLY="gemm attn.wo_b m=16,gemm shared_experts.w13 m=16,gemm-per attn.wo_b m=16,gemm-per shared_experts.w13 m=16,gemm-per shared_experts.w1 m=16,gemm-per attn.wq_a m=16" DEEPINFER_BENCH_JSON="$r/ops-narrow16.json" timeout 150 "$here/benches/deepinfer-kernels-ffi-gpu_ops" --bench > "$r/ops-narrow16.log" 2>&1
echo "== narrow m=16 (${SECONDS}s)"; grep -E "^gemm" "$r/ops-narrow16.log" | cut -c1-75,150-230
save
fi
if [ "$part" != ops ]; then
SECONDS=0; ( timeout 150 "$here/tests/deepinfer-kernels-ffi-gpu_parity" --test-threads 1 2>&1 | cut -c1-300 > "$r/gpu_parity-tests.log" ); echo "parity ${SECONDS}s"; tail -3 "$r/gpu_parity-tests.log"
SECONDS=0; ( timeout 150 "$here/tests/deepinfer-moe-gpu_moe" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$r/gpu_moe-tests.log" ); echo "moe tests ${SECONDS}s"; tail -3 "$r/gpu_moe-tests.log"
save
for n in 1 2; do
  for b in after before; do
    bin="$here/benches/deepinfer-moe-gpu_moe"; [ $b = before ] && bin="$here/benches/gpu_moe-before"
    SECONDS=0
    DEEPINFER_MOE_TOKENS=1 DEEPINFER_BENCH_JSON="$r/moe-1-$b-r$n.json" timeout 90 "$bin" --bench > "$r/moe-1-$b-r$n.log" 2>&1
    echo "== moe 1 $b r$n ${SECONDS}s"; grep -E "settled|prefetch|then_down|routed_down_gemm |routed_gate_up_gemm |moe layer" "$r/moe-1-$b-r$n.log" | cut -c1-200
    save
  done
done
DEEPINFER_MOE_TOKENS=16,64 DEEPINFER_BENCH_JSON="$r/moe-16-64.json" timeout 100 "$here/benches/deepinfer-moe-gpu_moe" --bench > "$r/moe-16-64.log" 2>&1
grep -E "settled|prefetch|then_down|moe layer|routed_down_gemm |routed_gate_up_gemm " "$r/moe-16-64.log" | cut -c1-200
save
fi
echo done
