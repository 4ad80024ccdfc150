#!/usr/bin/env bash
# Visit (twenty-first session): (1) gpu_attention decode tests (the new chained-calls test: PDL on
# and off give the same bits) and the decode bench twice (default rows with PDL, "/nopdl" rows
# without, same binary); (2) the twentieth session's pending visit (benches/pending/fp4-scale-variants.sh):
# narrow W at 9 and 16 tokens, gpu_parity and gpu_moe tests with the new defaults, the MoE bench at
# one token for builds B (this one), C (no prefetch_l2 loop) and before (14f721c), alternating.
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
save() { tar czf "$out/visit.tgz" -C "$r" .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$r/doctor.txt" 2>&1
if [ "$part" = all ] || [ "$part" = attn ]; then
  SECONDS=0
  timeout 120 "$here/tests/deepinfer-kernels-ffi-gpu_attention" --test-threads 1 --nocapture gpu_attention_decode > "$r/attn-tests.log" 2>&1; echo "tests exit $?" >> "$r/attn-tests.log"
  echo "== attn tests ${SECONDS}s"; grep -E "test result|panicked|chained|exit" "$r/attn-tests.log" | cut -c1-200
  save
  for n in 1 2; do
    SECONDS=0
    DEEPINFER_BENCH_ONLY="attention_decode" DEEPINFER_BENCH_JSON="$r/attn-bench$n.json" timeout 120 "$here/benches/deepinfer-kernels-ffi-gpu_attention" --bench > "$r/attn-bench$n.log" 2>&1
    echo "== attn bench $n ${SECONDS}s"; grep -o "attention_decode.*" "$r/attn-bench$n.log" | grep -v "f32merge\|gather\|di_attn_decode  " | sed -E 's/batch=64 heads=64 //; s/ +[0-9.]+ MB  median/ median/; s/ +[0-9]+ GB\/s.*graph/ graph/' | cut -c1-150
    save
  done
fi
if [ "$part" = all ] || [ "$part" = pending ]; then
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
fi
echo done
