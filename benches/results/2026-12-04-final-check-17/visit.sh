#!/usr/bin/env bash
# final check of the seventeenth session: tests, the decode GEMM rows, wo_b's per sweep, the MoE bench
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
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/doctor.txt" 2>&1
( timeout 150 "$here/tests-deepinfer-kernels-ffi-gpu_parity" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$out/gpu_parity-tests.log" ); tail -2 "$out/gpu_parity-tests.log"
( timeout 120 "$here/tests-deepinfer-moe-gpu_moe" --test-threads 1 --nocapture 2>&1 | cut -c1-300 > "$out/gpu_moe-tests.log" ); tail -2 "$out/gpu_moe-tests.log"
cd "$out"
DEEPINFER_BENCH_ONLY="gemm ,gemm-cluster ,gemm-per attn.wo_b" timeout 170 "$here/benches-deepinfer-kernels-ffi-gpu_ops" --bench > "$out/gpu_ops-bench.log" 2>&1; echo "ops rc $?"
timeout 120 "$here/benches-deepinfer-moe-gpu_moe" --bench > "$out/gpu_moe-bench.log" 2>&1; echo "moe rc $?"
ls "$out" "$here"
grep -E "_dec_|gemm-per" "$out/gpu_ops-bench.log" | sed 's/Fp8Block128//; s/ median.*GPU-queued/ q/; s/without PDL[^;]*;//; s/|.*//' | cut -c1-140
grep -E "GPU-queued|layer" "$out/gpu_moe-bench.log" | grep -v "_pre_" | cut -c1-150 | head -30
echo done
