#!/usr/bin/env bash
# scratch: attention decode fixed-cost modes, PDL on/off
out=$1; mkdir -p "$out"
packed=$(cd "$(dirname "$0")" && pwd)
here=$(mktemp -d)
for f in benches/deepinfer-kernels-ffi-gpu_attention tests/deepinfer-kernels-ffi-gpu_attention; do
python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$packed/$f.xz" "$here/$(dirname $f)"; chmod +x "$here/$(dirname $f)"; done
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export DEEPINFER_REQUIRE_GPU=1
if [ -n "${TESTS:-}" ]; then timeout 200 "$here/tests" --test-threads 1 2>&1 | cut -c1-300 | tee "$out/tests.log" | tail -8; fi
ONLY=${ONLY:-attention_decode}
for pdl in on off; do
for e in ${EXPS:-0}; do
  if [ $pdl = off ]; then export DEEPINFER_ATTN_NOPDL=1; else unset DEEPINFER_ATTN_NOPDL; fi
  echo "### pdl=$pdl exp=$e" | tee -a "$out/exp.log"
  DEEPINFER_EXP_ATTN=$e DEEPINFER_BENCH_ONLY="$ONLY" timeout 100 "$here/benches" --bench 2>&1 | grep "attention_decode" | grep -v "di_attn_decode  \|/gather" | sed 's/batch=64 heads=64 //' | cut -c1-200 | tee -a "$out/exp.log"
done; done
