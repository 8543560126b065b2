#!/usr/bin/env bash
# The routing proxy (BENCHMARKS.md section 11), in one call on the H200: train it, trace it over the shipped
# workloads, compute its metrics, and check that its trace drives LLaDA2.0-mini shapes (`oled bench --routing`).
#
#   OUT=out bash benchmarks/routing_proxy.sh        (device: data/proxy-corpus carried, see below)
#
# The proxy has LLaDA2.0-mini's routing geometry (1 dense + 19 MoE layers, 256 routed experts, top-8, 8 groups with
# the best 4 kept, sigmoid scores, expert bias balanced without an auxiliary loss, one shared expert, routed scaling
# 2.5) at the bundled model's widths (hidden 256, experts of 32), trained with the bundled model's objective, recipe
# and data. The corpus is the bundled model's exactly (same file selection, same tokenizer):
#   python -m oled.train.corpus --out data/proxy-corpus --no-tokenize
#   cp oled/assets/tiny-model/tokenizer.json data/proxy-corpus/   (then tokenize: oled.train.corpus.load_corpus_ids)
# Results: $OUT/proxy-{code,math,chat}.trace (each under the device's 16 MiB return limit: 2 code prompts of 256
# tokens are about 12 MB at one token per forward) and $OUT/proxy-results.tgz (training log, metrics, the block-length
# traces, the replay check).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/res; W=${WORK:-/tmp/proxy}; mkdir -p $R $W
CORPUS=${CORPUS:-data/proxy-corpus}
MINUTES=${MINUTES:-5.0}
TRAIN_ARGS=${TRAIN_ARGS:---batch-size 32 --warmup 100}
PROXY_MODEL=${PROXY_MODEL:-num_hidden_layers=20 num_experts=256 num_experts_per_tok=8 n_group=8 topk_group=4
                           first_k_dense_replace=1 num_shared_experts=1 hidden_size=256 moe_intermediate_size=32}
GEN=${GEN:-256}; SHORT_GEN=${SHORT_GEN:-128}
REPLAY_MODEL=${REPLAY_MODEL:---random-weights llada2-mini}
model_args=""; for kv in $PROXY_MODEL; do model_args="$model_args --model $kv"; done
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null;
  python3 -c "import torch; print('torch', torch.__version__)"; } > $R/hardware.txt
start=$(date +%s)
python3 -m oled.train.tiny --corpus $CORPUS --out $W/proxy --minutes $MINUTES $TRAIN_ARGS $model_args \
  > $R/train.log 2>&1 || { echo "training failed"; tail -30 $R/train.log; exit 1; }
echo "trained in $(( $(date +%s) - start )) s"; tail -4 $R/train.log
cp $W/proxy/train_log.json $W/proxy/config.json $R/
trace() { python3 -m oled.cli trace --model $W/proxy --policy full --threshold 0.95 "$@" >> $R/trace.log 2>&1 \
          || { echo "trace $* failed"; tail -20 $R/trace.log; exit 1; }; }
trace --workload code --prompts 2 --gen-length $GEN --block-length 32 --out $OUT/proxy-code.trace
trace --workload math --prompts 3 --gen-length $SHORT_GEN --block-length 32 --out $OUT/proxy-math.trace
trace --workload chat --prompts 3 --gen-length $SHORT_GEN --block-length 32 --out $OUT/proxy-chat.trace
for b in 8 16 24; do
  trace --workload code --prompts 2 --gen-length $SHORT_GEN --block-length $b --out $R/proxy-code-b$b.trace
done
echo "traced at $(( $(date +%s) - start )) s"; ls -la $OUT/*.trace $R/*.trace
python3 benchmarks/proxy_metrics.py --train-log $R/train_log.json --trace code=$OUT/proxy-code.trace \
  --trace math=$OUT/proxy-math.trace --trace chat=$OUT/proxy-chat.trace --block 8=$R/proxy-code-b8.trace \
  --block 16=$R/proxy-code-b16.trace --block 24=$R/proxy-code-b24.trace --block 32=$OUT/proxy-code.trace \
  --out $R/proxy_metrics.json 2>&1 | tee $R/proxy_metrics.txt
python3 -m oled.cli trace --report $OUT/proxy-code.trace > $R/proxy-code.locality.txt 2>&1
# the trace drives the real-size model: one request, full and lru at 40 %, every token the trace's
start=$(date +%s)
timeout ${SMOKE_S:-200} python3 -m oled.cli bench --routing $OUT/proxy-code.trace $REPLAY_MODEL --policies full,lru \
  --budgets 1.0,0.4 --prompts 1 --repeats 1 --warmup 0 --no-profile --no-progress --out $R/replay-check \
  > $R/replay-check.log 2>&1; echo "replay check rc=$? in $(( $(date +%s) - start )) s"; tail -5 $R/replay-check.log
tar czf $OUT/proxy-results.tgz -C $OUT res; ls -la $OUT
