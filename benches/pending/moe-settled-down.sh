#!/usr/bin/env bash
# Pending visit (eighteenth session; no device was lent): gpu_moe tests, then the MoE bench at 1 token twice and at 16 and 64 tokens once
# (the settled down GEMM and the layer with it off and on come from the same binary).
# Use: cargo xtask gpu-bundle --only gpu_moe; cp benches/pending/moe-settled-down.sh target/gpu-bundle/go.sh;
# then on the GPU machine (device tool, carry target/gpu-bundle): bash target/gpu-bundle/go.sh "$OUT".
set -u
out=${1:?}
d=$(cd "$(dirname "$0")" && pwd)
here=$(mktemp -d)
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
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$out/doctor.txt" 2>&1
( timeout 200 "$here/tests/deepinfer-moe-gpu_moe" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$out/gpu_moe-tests.log" ); tail -4 "$out/gpu_moe-tests.log"
for r in 1 2; do
  DEEPINFER_MOE_TOKENS=1 DEEPINFER_BENCH_JSON="$out/bench-1-r$r.json" timeout 100 "$here/benches/deepinfer-moe-gpu_moe" --bench > "$out/bench-1-r$r.log" 2>&1
  grep -E "settled|routed_down_gemm |routed_gate_up_gemm |moe layer" "$out/bench-1-r$r.log"
done
DEEPINFER_MOE_TOKENS=16,64 DEEPINFER_BENCH_JSON="$out/bench-16-64.json" timeout 150 "$here/benches/deepinfer-moe-gpu_moe" --bench > "$out/bench-16-64.log" 2>&1
grep -E "settled|moe layer" "$out/bench-16-64.log"
echo done
