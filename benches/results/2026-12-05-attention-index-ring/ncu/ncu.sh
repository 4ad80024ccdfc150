#!/usr/bin/env bash
# ncu of the decode attention kernels (gpu_attention bench): sp_c2 at HCA 128k (steady state) and wg_c2 at HCA 8k.
set -u
out=${1:?}
here=$(mktemp -d)
packed=$(cd "$(dirname "$0")" && pwd)
python3 - "$packed/benches/deepinfer-kernels-ffi-gpu_attention.xz" "$here/b" <<'PY'
import lzma, os, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as w:
    w.write(i.read())
os.chmod(sys.argv[2], 0o755)
PY
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/doctor.txt" 2>&1
run() {  # tag kernel only
  SECONDS=0
  DEEPINFER_BENCH_ONLY="$3" timeout 200 ncu --clock-control none --set full --import-source yes --kernel-name "$2" --launch-skip 6 --launch-count 1 -o "$here/$1" "$here/b" --bench > "$out/$1-run.txt" 2>&1
  echo "ncu $1: exit $? ${SECONDS}s"
  ncu -i "$here/$1.ncu-rep" --page details --print-details all > "$out/$1-details.txt" 2>&1
  ncu -i "$here/$1.ncu-rep" --page source --csv --print-source sass > "$out/$1-sass.csv" 2>&1
  ncu -i "$here/$1.ncu-rep" --page raw --csv > "$out/$1-raw.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Elapsed Cycles|SM Frequency|Registers|Achieved Occupancy" "$out/$1-details.txt" | head -12
}
run hca128k di_attn_decode_sp_c2 "attention_decode HCA 128k (128"
run hca8k di_attn_decode_wg_c2 "attention_decode HCA 8k (128"
ls -la "$out"
