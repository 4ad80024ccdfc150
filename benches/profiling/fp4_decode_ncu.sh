#!/usr/bin/env bash
# ncu (warp states, SASS source counters) of di_gemm_fp4q_wg_n* in the gpu_moe bench:
# copy into target/gpu-bundle after `cargo xtask gpu-bundle --only gpu_moe`, then on the GPU machine
# bash target/gpu-bundle/fp4_decode_ncu.sh OUTDIR TOKENS...
set -u
out=$1; shift; mkdir -p "$out"
here=$(mktemp -d)
packed=$(cd "$(dirname "$0")" && pwd)
python3 - "$packed/benches/deepinfer-moe-gpu_moe.xz" "$here/b" <<'PY'
import lzma, os, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as w:
    w.write(i.read())
os.chmod(sys.argv[2], 0o755)
PY
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
for t in "$@"; do
  DEEPINFER_MOE_TOKENS=$t timeout 200 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters --section Occupancy --section LaunchStats --import-source yes --kernel-name regex:di_gemm_fp4q_wg --launch-skip 20 --launch-count 2 -o "$here/rep$t" "$here/b" --bench > "$out/ncu-run-$t.txt" 2>&1
  echo "ncu $t: exit $?"
  ncu -i "$here/rep$t.ncu-rep" --page details --print-details all > "$out/ncu-details-$t.txt" 2>&1
  ncu -i "$here/rep$t.ncu-rep" --page source --csv --print-source sass > "$out/ncu-sass-$t.csv" 2>&1
done
