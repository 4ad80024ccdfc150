#!/usr/bin/env bash
# Source-level stall sampling of the sliding-only prefill attention kernel: ncu3.sh OUTDIR
set -u
out=$1; mkdir -p "$out"
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
timeout 240 ncu --clock-control none --section WarpStateStats --section SourceCounters --import-source yes --kernel-name di_attn_decode_wg --launch-skip 11 --launch-count 1 -o "$here/rep" "$here/b" --bench > "$out/ncu3-run.txt" 2>&1
echo "ncu run: exit $?"
ncu -i "$here/rep.ncu-rep" --page details --print-details all > "$out/ncu3-details.txt" 2>&1
ncu -i "$here/rep.ncu-rep" --page source --csv --print-source cuda > "$out/ncu3-source-cuda.csv" 2>&1
echo "source: exit $?"
ncu -i "$here/rep.ncu-rep" --page source --csv --print-source sass > "$out/ncu3-source-sass.csv" 2>&1
echo "sass: exit $?"
ls -la "$out"
