#!/usr/bin/env bash
# Visit: gpu_attention decode tests (the sp kernels' key-list ring), then the decode bench, ring build
# and before build alternating, two rounds.
set -u
out=${1:?}
d=$(cd "$(dirname "$0")" && pwd)
here=$(mktemp -d)
r=$(mktemp -d)
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
save() { tar czf "$out/visit.tgz" -C "$r" .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$r/doctor.txt" 2>&1
cat "$r/doctor.txt"
SECONDS=0
timeout 150 "$here/tests/deepinfer-kernels-ffi-gpu_attention" --test-threads 1 --nocapture gpu_attention_decode > "$r/tests.log" 2>&1; echo "tests exit $?" >> "$r/tests.log"
echo "== tests ${SECONDS}s"; grep -E "test result|panicked|exit" "$r/tests.log" | cut -c1-200
save
for n in 1 2; do
  for b in ring before; do
    bin="$here/benches/deepinfer-kernels-ffi-gpu_attention"; [ $b != ring ] && bin="$here/benches/gpu_attention-$b"
    SECONDS=0
    DEEPINFER_BENCH_ONLY="attention_decode" DEEPINFER_BENCH_JSON="$r/bench-$b-r$n.json" timeout 120 "$bin" --bench > "$r/bench-$b-r$n.log" 2>&1
    echo "== $b r$n ${SECONDS}s"; grep -o "attention_decode.*" "$r/bench-$b-r$n.log" | grep -v "f32merge\|gather\|nopdl\|di_attn_decode  " | sed -E 's/batch=64 heads=64 //; s/ +[0-9.]+ MB  median/ median/; s/ +[0-9]+ GB\/s.*graph/ graph/' | cut -c1-150
    save
  done
done
echo done
