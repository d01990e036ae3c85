#!/usr/bin/env bash
# The 1.3B/1.5B recipes on one GPU (device tool), behind docs/results.md ("Recipes on one H100")
# and recipes/throughput.yaml:
#   device: carry [".whl", "data"]; command:
#     source .whl/setup.sh && bash tools/gpu_recipes.sh RECIPE[:MB] ...
# Each recipe runs its own model, optimizer and schedule shape (warm-up and cosine scaled to the
# run) for ITERS (300) iterations of GBS (8) sequences on the docs corpus (Mistral tokenizer), or on
# mock data (MOCK=1, for recipes with another tokenizer, e.g. sas-1.5b-50b-fineweb), at the
# recipe's micro-batch (or MB after a colon). Saves nothing. Metrics, logs and the effective config
# go to $OUT (EXTRA: more trainer flags, e.g. another --attention-variant; TAG: a suffix for
# the output names); the throughput rows are the mean "tokens per second per GPU" after WARM iterations.
set -euo pipefail
OUT=${OUT:-runs/gpu-recipes}; mkdir -p "$OUT"
ITERS=${ITERS:-300}; GBS=${GBS:-8}; WARM=${WARM:-20}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
if [ -z "${MOCK:-}" ] && [ ! -f data/docs_text_document.bin ]; then
  corpus=data/docs-corpus.jsonl.xz; [ -f $corpus ] || corpus=../shared/data/docs-corpus.jsonl.xz
  python3 tools/preprocess_data.py --input $corpus --output-prefix data/docs \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model mistral --workers 12 \
    > "$OUT/preprocess.log" 2>&1
fi
for spec in "$@"; do
  name=${spec%%:*}; mb=""; [ "$spec" != "$name" ] && mb=${spec#*:}
  cfg=$OUT/$name.yaml
  python3 - "recipes/$name.yaml" "$cfg" "$ITERS" "$GBS" "$mb" "${MOCK:-}" <<'PY'
import sys, yaml
src, dst, iters, gbs, mb, mock = sys.argv[1:7]
iters, gbs = int(iters), int(gbs)
c = yaml.safe_load(open(src))
for k in ("data-path", "data-args-path", "train-data-path", "valid-data-path", "test-data-path",
          "save", "load", "save-interval", "tensorboard-dir", "metrics-file", "train-iters", "train-samples",
          "lr-warmup-samples", "lr-warmup-iters", "lr-decay-samples", "lr-decay-iters",
          "lr-warmup-fraction", "exit-duration-in-mins", "exit-signal-handler"):
    c.pop(k, None)
c["micro-batch-size"] = min(int(mb) if mb else c["micro-batch-size"], gbs)
c.update({"global-batch-size": gbs, "train-iters": iters, "lr-warmup-iters": max(1, iters // 10),
          "eval-interval": iters, "eval-iters": 8, "log-interval": 10, "num-workers": 2})
if mock:
    c.update({"mock-data": True, "tokenizer-type": "NullTokenizer"})
    c.pop("tokenizer-model", None); c.pop("split", None)
else:
    c.update({"data-path": ["data/docs_text_document"], "split": "98,2,0"})
yaml.safe_dump(c, open(dst, "w"), sort_keys=False)
PY
  echo "== $name (micro-batch $(grep '^micro-batch-size' "$cfg"), $ITERS x $GBS)"
  set +e
  python3 examples/pretrain_gpt.py --config "$cfg" ${EXTRA:-} \
    --metrics-file "$OUT/$name${TAG:-}.jsonl" > "$OUT/$name${TAG:-}.log" 2>&1
  rc=$?
  set -e
  grep -E "parameters|iteration +[0-9]*0/|validation|Error|error|out of memory" "$OUT/$name${TAG:-}.log" \
    | grep -v -i warn | tail -8 || true
  echo "exit $rc"
  python3 - "$OUT/$name${TAG:-}.log" "$WARM" <<'PY' | tee "$OUT/$name${TAG:-}.throughput.txt"
import re, sys
rates, mem = [], None
for line in open(sys.argv[1]):
    m = re.search(r"iteration +(\d+)/.*tokens per second per GPU: ([\d.]+)", line)
    if m and int(m.group(1)) > int(sys.argv[2]):
        rates.append(float(m.group(2)))
    g = re.search(r"MFU: ([\d.]+)%", line)
    if g and m and int(m.group(1)) > int(sys.argv[2]):
        mem = g.group(1)
print(f"tokens/s/GPU after warm-up: {sum(rates) / len(rates):.0f} over {len(rates)} log lines; last MFU {mem}%"
      if rates else "no throughput lines")
PY
done
