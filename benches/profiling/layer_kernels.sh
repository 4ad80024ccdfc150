#!/usr/bin/env bash
# Per-kernel GPU durations (ncu, kernels serialised) of layer forwards in the gpu_moe bench: copy
# into target/gpu-bundle after `cargo xtask gpu-bundle --only gpu_moe`, then on the GPU machine
# bash target/gpu-bundle/layer_kernels.sh OUTDIR TOKENS...
set -u
out=$1; shift; mkdir -p "$out"
here=$(mktemp -d)
packed=$(cd "$(dirname "$0")" && pwd)
python3 -c "
import lzma,os,sys
o=sys.argv[2]; open(o,'wb').write(lzma.open(sys.argv[1]).read()); os.chmod(o,0o755)" "$packed/benches/deepinfer-moe-gpu_moe.xz" "$here/b"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
for t in "$@"; do
  DEEPINFER_MOE_TOKENS=$t timeout 200 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --launch-skip 40 --launch-count 22 --csv "$here/b" --bench > "$out/ncu-layer-$t.csv" 2> "$out/ncu-layer-$t.err"
  python3 - "$out/ncu-layer-$t.csv" <<'PY'
import csv, sys
lines = open(sys.argv[1]).read().splitlines()
start = [i for i, l in enumerate(lines) if l.startswith('"ID"')][0]
rows = list(csv.reader(lines[start:]))
h = rows[0]; ci = {n: i for i, n in enumerate(h)}
for r in rows[1:]:
    if len(r) == len(h):
        print(sys.argv[1].split('-')[-1], r[ci['ID']], r[ci['Kernel Name']][:40], r[ci['Metric Value']])
PY
done
