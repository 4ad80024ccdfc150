#!/usr/bin/env bash
# ncu of the sliding-only prefill attention kernel and the wq_b decode GEMM: ncu2.sh OUTDIR
set -u
out=$1; mkdir -p "$out"
here=$(mktemp -d)
packed=$(cd "$(dirname "$0")" && pwd)
python3 - "$packed/benches" "$here" <<'PY'
import lzma, os, sys
for f in os.listdir(sys.argv[1]):
    if f.endswith(".xz"):
        o = os.path.join(sys.argv[2], f[:-3])
        with lzma.open(os.path.join(sys.argv[1], f)) as i, open(o, "wb") as w:
            w.write(i.read())
        os.chmod(o, 0o755)
PY
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats"
# Prefill: di_attn_decode_wg launches 5 CSA (TMA), 5 CSA (gathered), then the sliding-only ones.
timeout 200 ncu --clock-control none $S --kernel-name di_attn_decode_wg --launch-skip 11 --launch-count 1 "$here/deepinfer-kernels-ffi-gpu_attention" --bench > "$out/ncu-sliding-prefill.txt" 2>&1
echo "attention ncu: exit $?"
DEEPINFER_BENCH_ONLY="gemm attn.wq_b m=1" timeout 150 ncu --clock-control none $S --kernel-name di_gemm_fp8_dec_n8 --launch-skip 5 --launch-count 1 "$here/deepinfer-kernels-ffi-gpu_ops" --bench > "$out/ncu-wq_b-m1.txt" 2>&1
echo "gemm ncu: exit $?"
