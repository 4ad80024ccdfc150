#!/usr/bin/env bash
# Visit: gpu_attention tests, then the decode bench twice (f16 merge default vs /f32merge rows in each).
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
"$here/tests/deepinfer-kernels-ffi-gpu_attention" --test-threads 1 --nocapture gpu_attention_decode > "$out/tests.log" 2>&1; echo "tests exit $?" >> "$out/tests.log"
for r in 1 2; do
  DEEPINFER_BENCH_ONLY="attention_decode" DEEPINFER_BENCH_JSON="$out/bench$r.json" "$here/benches/deepinfer-kernels-ffi-gpu_attention" --bench > "$out/bench$r.log" 2>&1
  echo "bench exit $?" >> "$out/bench$r.log"
done
