#!/usr/bin/env bash
# The tiny DeepSeek-V4 model, end to end: tools/tiny-model/pipeline.sh [prepare] [train] [export] (default: all)
#   prepare  corpus.py + tokenizer.py -> target/tiny-model/{corpus,tokenizer,data}   (needs the registries)
#   train    train.py -> $RUN (default target/tiny-model/run)                         (needs a GPU)
#   export   export.py -> models/deepinfer-tiny-v4, then the engine's parity check on it
# On a machine with both network and a GPU, `pipeline.sh` does everything. Here the GPU machine has no
# network, so `prepare` and `export` run on this machine and `train` on the GPU machine, carrying
# target/tiny-model/{data,tokenizer,wheels} (see tools/tiny-model/README.md for the exact command).
# Environment: PYTHON (python3), RUN (target/tiny-model/run), MINUTES (7.0 of training).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
D=target/tiny-model
RUN=${RUN:-$D/run}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(prepare train export)
for s in "${stages[@]}"; do
  echo "== $s" >&2
  case $s in
    prepare)
      $PY tools/tiny-model/corpus.py --dir $D/corpus
      $PY tools/tiny-model/tokenizer.py --dir $D ;;
    train)
      $PY tools/tiny-model/train.py --data $D/data --tokenizer $D/tokenizer/tokenizer.json --out "$RUN" \
        --minutes "${MINUTES:-7.0}" ;;
    export)
      $PY tools/tiny-model/export.py --run "$RUN" --dir $D --out models --seq 80 --prefill 60
      # Shipped compressed (the loader inflates *.safetensors.gz): the tracked tree stays small.
      gzip -9 -n -f models/deepinfer-tiny-v4/model.safetensors models/deepinfer-tiny-v4/reference.safetensors
      cargo run --release -p deepinfer -- check-parity --model models/deepinfer-tiny-v4 ;;
    *) echo "unknown stage $s (prepare, train, export)" >&2; exit 2 ;;
  esac
done
