#!/usr/bin/env bash
# Visit for issue #37 (written 2026-12-07 before the run): the device model on the GPU end to end.
#
# Part "tests": tests/gpu_device_model.rs (CUDA vs the cpu backend on a random 4-layer checkpoint
#   with V4 attention geometry; decode step times printed).
# Part "ours": `deepinfer random-model` (V4-Flash layer shapes, 4 layers, 256 experts), then
#   `deepinfer generate --device cuda` and `deepinfer bench --device cuda` on it.
# Part "peer": benches/peers/model_torch.py, transformers' DeepseekV4ForCausalLM bf16 eager on the
#   same config.json (27.4B parameters at 4 layers), same card, same visit.
#
# Predictions (before any run):
# - tests: the bf16 comparison passes (median within 2e-2); the official one reports a median of
#   about 5e-2 to 1e-1 (the noise the cpu-backend comparison showed).
# - ours, decode batch 1: a step reads ~0.76 GB of layer weights (FP8 dense ~113 MB, shared expert
#   25 MB, 6 FP4 experts 26 MB, compressors 20 MB a layer) plus the 1.06 GB bf16 head: ~1.8 GB, a
#   floor of ~0.55 ms at 3.3 TB/s. The forward is eager: ~80 ops a layer each allocating its
#   outputs and the host building key lists and syncing for the logits, so ~8-15 ms a step
#   (70-120 tok/s), 0.04-0.07 of the floor; batch 8 about the same step time (8x the tok/s).
#   Prefill 2048: attention runs the decode kernel per query (not the dense prefill kernel) and
#   the indexer per token, so a few thousand tok/s at most.
# - peer: ~40 tok/s at batch 1 (GPU.md measured 39 on the H200), prefill ~13k tok/s at 8k.
#   So ours ~2-3x the peer at batch 1 decode (target 20x: missed; the step breakdown decides what
#   to fix first), below it at prefill.
#
# Build (this machine): cargo xtask kernels && cargo xtask gpu-bundle --only gpu_device_model
#   cp target/release/deepinfer target/gpu-bundle/   (built with --features deepinfer/cuda)
#   cp benches/pending/visit-37.sh benches/peers/model_torch.py target/gpu-bundle/
# Device call: carry ["target/gpu-bundle"], command `bash target/gpu-bundle/visit-37.sh "$OUT" "tests ours"`
#   then `... "$OUT" peer` while the machine is warm (the model stays in /tmp/v4).
# Second visit (written 2026-12-07 before it ran), after: host sampling spread over the cores
# (one thread spent ~0.5 ms a request at batch 64), the step breakdown split into decode and
# prefill forwards, the batch-invariance check moved to its own ignored test (run here with --ignored).
# Predictions: decode batch 64 at context 512 rises from 552 tok/s to >= 2000 (the forward ~10 ms,
# the host sampling ~3 ms on 16 cores); batch 1 from 180 to ~200 (sampling ~0.7 ms of the 5.6 ms);
# decode at 4k context about 10% slower than at 512 (the compressed keys grow by 4x, the window
# does not); prefill 8k ~30k tok/s, 32k ~25k tok/s; the batch-invariance test still fails (nothing in
# the kernel dispatch changed); the copy bandwidth ~3.0 TB/s on the H100 (3.35 TB/s peak).
# Third visit (written before it ran): the bench's decode figures now come from the window in which
# every request of the batch decodes (the second visit's batch-64 figures mixed in prefill steps of
# the later requests: its ITL of 27 ms against 4.45 ms of pure decode forward). So more tokens a
# request. Predictions: batch 64 at 512 context ~9-10k tok/s (a ~3.5 ms forward plus ~2-3 ms of
# parallel sampling); batch 256 at 4k ~12-15k tok/s; batch 1 unchanged at ~230 tok/s; the profile's
# ITL within 1.5x of its forward sum at batch 64.
# Next visit (written 2026-12-07 after the third): rerun "ours" with the scheduler fix and the
# device-cache block count; predictions: batch 64 at 4k context ~2.5k tok/s (the host side of the
# step dominates as at 512), batch 256 ~3-4k tok/s; batch 1 and 64 at 512 as in visit 3.
# Fourth visit (written 2026-12-07, session 48, before it ran): also issue #42's GPU parity re-run after
# kernels-ffi's shapes, switches and dispatch decisions moved to src/shapes/ (no behaviour change).
# Build the "tests" part with every GPU test: `cargo xtask gpu-bundle --only
# gpu_parity,gpu_attention,gpu_moe,gpu_compressor,gpu_hc,gpu_rows,gpu_sampling,gpu_device_model`
# (split into part-N folders if over the carry limit: one device call each). Prediction: every test
# passes as in the last final check (2026-12-04-final-check-17), gpu_batch_invariance still fails.
set -u
out=${1:?}
parts=${2:-tests ours peer}
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
mkdir -p "$out/logs"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
bin="$here/deepinfer"
[ -f "$bin.xz" ] && python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$bin.xz" "$bin"
chmod +x "$bin" 2>/dev/null
model=/tmp/v4
for p in $parts; do
  case $p in
    tests)
      timeout 300 bash "$here/run.sh" "$out/logs" > "$out/logs/tests-run.log" 2>&1; echo "tests rc=$?"
      grep -v "step [0-9]*: error" "$out/logs/tests.log" | tail -14
      . "$here/bundle.sh"; td=$(mktemp -d); unpack_bundle "$here" "$td"
      for x in "$td"/tests/*gpu_device_model*; do timeout 200 "$x" --ignored --nocapture gpu_batch_invariance > "$out/logs/invariance.log" 2>&1; echo "invariance rc=$?"; tail -8 "$out/logs/invariance.log"; done ;;
    ours)
      "$bin" doctor > "$out/logs/doctor-ours.txt" 2>&1
      [ -f $model/config.json ] || timeout 400 "$bin" random-model --out $model --layers 4 --experts 256 2>&1 | tail -2
      cp $model/config.json "$out/logs/model-config.json"
      timeout 120 "$bin" generate --device cuda --model $model --max-running 8 --max-context 4096 \
        --prompt "The GPU says" --max-tokens 16 > "$out/logs/generate.txt" 2>&1; echo "generate rc=$?"; tail -3 "$out/logs/generate.txt"
      timeout 300 "$bin" bench --device cuda --model $model --max-running 64 --max-context 4096 \
        --prefill 512,2048 --suffix 64 --decode-batch 1,8,64 --decode-context 512 --decode-tokens 160 \
        --out "$out/bench-ours.json" > "$out/logs/bench-ours.log" 2>&1; echo "bench rc=$?"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(d) for d in r['decode']+r['prefill']]" "$out/bench-ours.json"
      # 256 x 4k prompts prefill in 8k-token steps (the default 512 would take 2048 steps, and the
      # first requests would finish before the last began decoding).
      timeout 400 "$bin" bench --device cuda --model $model --max-running 256 --max-context 36864 --token-budget 8192 \
        --prefill 8192,32768 --suffix 64 --decode-batch 64,256 --decode-context 4096 --decode-tokens 512 \
        --out "$out/bench-long.json" > "$out/logs/bench-long.log" 2>&1; echo "bench-long rc=$?"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(d) for d in r['decode']+r['prefill']]" "$out/bench-long.json"
      # The step breakdown: every forward section closed by a sync (slower; its own run).
      DEEPINFER_PROFILE=1 timeout 300 "$bin" bench --device cuda --model $model --max-running 64 --max-context 4096 \
        --prefill 512 --suffix 64 --decode-batch 1,64 --decode-context 512 --decode-tokens 160 \
        --out "$out/bench-profile.json" > "$out/logs/bench-profile.log" 2>&1; echo "profile rc=$?"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(p['batch'], 'forward', round(p['forward_ms_per_step'],2), 'itl', round(p['itl_p50_ms'],2), [(s['section'], round(s['ms_per_step'],3)) for s in p['sections']]) for p in r['decode_profile']]" "$out/bench-profile.json" ;;
    copy)
      /opt/torch/.venv/bin/python -c "
import torch,time
x=torch.empty(2**31,dtype=torch.uint8,device='cuda'); y=torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t=time.perf_counter()
for _ in range(20): y.copy_(x)
torch.cuda.synchronize(); dt=(time.perf_counter()-t)/20
print('{\"copy_bytes\": %d, \"seconds\": %.6f, \"read_plus_write_GBps\": %.1f}' % (2**31, dt, 2*2**31/dt/1e9))
" | tee "$out/copy.json" ;;
    peer)
      cd "$here" && timeout 500 /opt/torch/.venv/bin/python model_torch.py $model "$out/peer.json" \
        --prefill 512,2048 --decode 1,8,64 --context 512 --new 32 > "$out/logs/peer.log" 2>&1; echo "peer rc=$?"; tail -12 "$out/logs/peer.log" ;;
  esac
done
# At most 8 files come back from $OUT: the logs travel as one archive.
tar -C "$out" -czf "$out/logs.tgz" logs && rm -rf "$out/logs"
