#!/usr/bin/env bash
# visit 4: gpu_moe tests; the FP4 down GEMM's guessed x row at one token (before/after alternated twice)
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
( timeout 150 "$here/tests-deepinfer-moe-gpu_moe" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$out/gpu_moe-tests.log" ); tail -3 "$out/gpu_moe-tests.log"
for round in 1 2 3; do
  for v in before after; do
    b="$here/benches-deepinfer-moe-gpu_moe"; [ $v = before ] && b="$here/benches-moe-bench-before"
    echo "### round $round $v" >> "$out/ab-moe.log"
    DEEPINFER_MOE_TOKENS=1 timeout 60 "$b" --bench 2>&1 | grep -E "routed_(gate_up|down)_gemm |routed_(gate_up|down)_gemm_pre|layer" >> "$out/ab-moe.log"
  done
done
grep -E "round|GPU-queued|graph a forward" "$out/ab-moe.log" | grep -v "_pre_\|earlier"
echo done
