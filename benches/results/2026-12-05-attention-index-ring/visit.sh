#!/usr/bin/env bash
# Visit: every gpu_attention test (decode, chained calls, paged, prefill, indexer), then the decode
# bench, this build (the sp kernels' key-list ring; the row copies' rows four a shared load) and
# the before build (33ea608's kernels) alternating, two rounds.
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
timeout 240 "$here/tests/deepinfer-kernels-ffi-gpu_attention" --test-threads 1 --nocapture > "$r/tests.log" 2>&1; echo "tests exit $?" >> "$r/tests.log"
echo "== tests ${SECONDS}s"; grep -E "^test |test result|panicked|exit" "$r/tests.log" | cut -c1-200
save
for n in 1 2; do
  for b in after before; do
    bin="$here/benches/deepinfer-kernels-ffi-gpu_attention"; [ $b != after ] && bin="$here/benches/gpu_attention-$b"
    SECONDS=0
    DEEPINFER_BENCH_ONLY="attention_decode" DEEPINFER_BENCH_JSON="$r/bench-$b-r$n.json" timeout 120 "$bin" --bench > "$r/bench-$b-r$n.log" 2>&1
    echo "== $b r$n ${SECONDS}s"; grep -o "attention_decode.*" "$r/bench-$b-r$n.log" | grep -v "f32merge\|gather\|nopdl\|di_attn_decode  " | sed -E 's/.*(di_attn_decode_[a-z0-9_]+) +([A-Za-z]+ [^ ]+).*achieved.floor ([0-9.]+).*graph ([0-9.]+) ms +([0-9.]+).*/\1 \2 \3 graph \5/'
    save
  done
done
echo done
