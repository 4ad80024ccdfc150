#!/usr/bin/env bash
# visit 2: gpu_parity; the split sums' loads batched (before/after alternated twice)
out=${1:?}; mkdir -p "$out"
packed=$(cd "$(dirname "$0")" && pwd)
here=$(mktemp -d)
python3 - "$packed" "$here" <<'PY'
import lzma, os, sys
src, dst = sys.argv[1], sys.argv[2]
for d in ("tests", "benches"):
    for f in os.listdir(os.path.join(src, d)):
        o = os.path.join(dst, d + "-" + f[:-3])
        with lzma.open(os.path.join(src, d, f)) as i, open(o, "wb") as w:
            w.write(i.read())
        os.chmod(o, 0o755)
PY
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export DEEPINFER_REQUIRE_GPU=1
( timeout 150 "$here/tests-deepinfer-kernels-ffi-gpu_parity" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$out/gpu_parity-tests.log" ); tail -3 "$out/gpu_parity-tests.log"
ONLY="gemm attn.wq_a m=1,gemm attn.wq_a m=4,gemm attn.wq_b m=1,gemm attn.wo_b m=1,gemm attn.wo_b m=4,gemm shared_experts.w1 m=1,gemm shared_experts.w1 m=4,gemm shared_experts.w13 m=1,gemm shared_experts.w13 m=4,gemm-cluster "
for round in 1 2; do
  for v in before after; do
    b="$here/benches-deepinfer-kernels-ffi-gpu_ops"; [ $v = before ] && b="$here/benches-ops-before"
    echo "### round $round $v" >> "$out/ab-ops.log"
    DEEPINFER_BENCH_ONLY="$ONLY" timeout 100 "$b" --bench 2>&1 | grep -E "^gemm" >> "$out/ab-ops.log"
  done
done
grep -E "round|_dec_" "$out/ab-ops.log" | sed 's/Fp8Block128//; s/ median.*achieved.floor/ /' | cut -c1-150
echo done
