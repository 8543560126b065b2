#!/usr/bin/env bash
# The routing proxy (BENCHMARKS.md, "Routing proxy") in one device call of under 10 minutes: train it, choose the commit
# threshold that gives LLaDA2.0-mini's tokens per forward on a calibration set, record the chat, math and code traces
# at that threshold, and print their statistics beside LLaDA2.0-mini's published ones.
#
#   OUT=$OUT MINUTES=6 bash benchmarks/routing_proxy.sh        (device; carry data/proxy-corpus)
#
# The proxy has LLaDA2.0-mini's routing geometry (1 dense + 19 MoE layers, 256 routed experts, top-8, 8 groups with
# the best 4 kept, sigmoid scores, expert bias balanced without an auxiliary loss, one shared expert, routed scaling
# 2.5) at the bundled model's widths (hidden 256, experts of 32), trained with the bundled model's objective, recipe
# and data. The corpus is the bundled model's (same file selection, same tokenizer), 2.8 MB to carry:
#   python -m oled.train.corpus --out data/proxy-corpus --no-tokenize --gzip --tokenizer oled/assets/tiny-model/tokenizer.json
#
# Settings (environment):
#   MINUTES      training wall time, its evaluation and checkpoint included (default 6)
#   BIAS_RATE    the expert-bias balancing rate (--bias-rate, default 1e-2). The bundled model's 1e-3 left the
#                proxy's busiest expert at several times the mean load after the steps one call allows; a faster
#                rate balances within them, and balanced experts spread a block's tokens (its masked positions, which
#                look alike to a briefly trained model, most of all) over more experts
#   TRAIN_ARGS   further oled.train.tiny flags (batch, warm-up); PROXY_MODEL the geometry (KEY=VALUE ...); the
#                default with num_hidden_layers=32 is LLaDA2.0-flash's routing geometry (31 MoE layers, the rest as
#                mini's), whose traces replay with `oled bench --routing TRACE --random-weights llada2-flash`
#   THRESHOLDS, REFINE, CALIBRATION, CAL_GEN   the threshold sweep (benchmarks/proxy_threshold.py)
#   GEN, SHORT_GEN, {CHAT,MATH,CODE}_PROMPTS, MIN_PROMPTS   the recorded traces: PROMPTS requests of GEN tokens;
#                a trace over MAX_TRACE_MB keeps its first requests down to MIN_PROMPTS, then is recorded again with
#                SHORT_GEN tokens (the device returns files of 16 MiB at most)
#   DEADLINE_S   seconds from the start by which everything has ended: the threshold sweep and the traces are cut
#                to the time left but STATS_S, which the statistics and packing keep
#   GRID_AFTER   with time left after the statistics: the policy grid on the new chat trace at LLaDA2.0-mini's
#                shapes (`oled bench --routing`, GRID_POLICIES at GRID_BUDGETS, the first GRID_PROMPTS requests,
#                with the bound rows), its result lines as routing-grid-results.jsonl (default on)
# Results in $OUT (8 files at most): proxy-{chat,math,code}.trace, threshold.json (the sweep and the choice),
# routing-grid-results.jsonl (GRID_AFTER),
# proxy_metrics.txt (the statistics) and proxy-results.tgz (training log and config, logs, metrics JSON, the traces'
# locality reports), packed again after every stage so that a cut run still returns what it did.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; W=${WORK:-/tmp/proxy}; R=$W/res; mkdir -p $OUT $R    # R: what proxy-results.tgz packs
CORPUS=${CORPUS:-data/proxy-corpus}
MINUTES=${MINUTES:-6}
BIAS_RATE=${BIAS_RATE:-1e-2}
TRAIN_ARGS=${TRAIN_ARGS:---batch-size 32 --warmup 100}
PROXY_MODEL=${PROXY_MODEL:-num_hidden_layers=20 num_experts=256 num_experts_per_tok=8 n_group=8 topk_group=4
                           first_k_dense_replace=1 num_shared_experts=1 hidden_size=256 moe_intermediate_size=32}
THRESHOLDS=${THRESHOLDS:-0.8,0.5,0.2}; REFINE=${REFINE:-3}; CAL_GEN=${CAL_GEN:-128}
CALIBRATION=${CALIBRATION:-chat:-1,math:-1,code:-1}
GEN=${GEN:-256}; SHORT_GEN=${SHORT_GEN:-128}; BLOCK=${BLOCK:-32}
CHAT_PROMPTS=${CHAT_PROMPTS:-3}; MATH_PROMPTS=${MATH_PROMPTS:-3}; CODE_PROMPTS=${CODE_PROMPTS:-3}; MIN_PROMPTS=${MIN_PROMPTS:-3}
MAX_TRACE_MB=${MAX_TRACE_MB:-15.5}; DEADLINE_S=${DEADLINE_S:-575}; STATS_S=${STATS_S:-30}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() {  # seconds left before the deadline less a reserve (default STATS_S; $1: another), at least 1
  local s=$(( DEADLINE_S - $(elapsed) - ${1:-$STATS_S} )); [ $s -gt 1 ] && echo $s || echo 1; }
pack() { tar czf $OUT/proxy-results.tgz -C $W res; }
model_args=""; for kv in $PROXY_MODEL; do model_args="$model_args --model $kv"; done
[ -f $CORPUS/tokenizer.json ] || { echo "no corpus at $CORPUS (build it: see the head of this script)"; exit 2; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null;
  python3 -c "import torch; print('torch', torch.__version__)"; git rev-parse HEAD 2>/dev/null; } > $R/hardware.txt

python3 -m oled.train.tiny --corpus $CORPUS --out $W/proxy --minutes $MINUTES --bias-rate $BIAS_RATE $TRAIN_ARGS \
  $model_args > $R/train.log 2>&1 || { echo "training failed"; tail -30 $R/train.log; pack; exit 1; }
cp $W/proxy/train_log.json $W/proxy/config.json $R/
echo "trained at $(elapsed) s"; grep "steps in" $R/train.log; tail -3 $R/train.log; pack

timeout $(left) python3 benchmarks/proxy_threshold.py --model $W/proxy --thresholds $THRESHOLDS --refine $REFINE \
  --prompts $CALIBRATION --gen-length $CAL_GEN --block-length $BLOCK --out $OUT/threshold.json \
  > $R/threshold.out 2> $R/threshold.log || { echo "threshold sweep failed"; tail -20 $R/threshold.log; pack; exit 1; }
TH=$(tail -1 $R/threshold.out)
cat $R/threshold.log; echo "threshold $TH chosen at $(elapsed) s"; pack

trace() {  # FILE WORKLOAD PROMPTS GEN
  timeout $(left) python3 -m oled.cli trace --model $W/proxy --policy full --threshold $TH --workload $2 \
    --prompts $3 --gen-length $4 --block-length $BLOCK --out $1 >> $R/trace.log 2>&1
}
too_big() { [ $(stat -c %s $1) -gt $(python3 -c "print(int($MAX_TRACE_MB * 2**20))") ]; }
record() {  # NAME WORKLOAD PROMPTS: the trace, its first requests where it is too big, shorter outputs if need be
  local t=$OUT/proxy-$1.trace n=$3 gen=$GEN
  echo "== $1: $2, $n prompts of $gen tokens, threshold $TH (at $(elapsed) s)" >> $R/trace.log
  trace $t $2 $n $gen || { echo "trace $1 failed or ran out of time"; tail -5 $R/trace.log; rm -f $t; return 1; }
  while too_big $t; do
    if [ $n -gt $MIN_PROMPTS ]; then
      n=$((n - 1)); python3 -m oled.cli trace --report $t --first $n --out $t.tmp >> $R/trace.log 2>&1 && mv $t.tmp $t
    elif [ $gen -gt $SHORT_GEN ]; then
      n=$3; gen=$SHORT_GEN; trace $t $2 $n $gen || { echo "trace $1 failed"; rm -f $t; return 1; }
    else
      echo "trace $1 stays over $MAX_TRACE_MB MiB: not kept"; rm -f $t; return 1
    fi
  done
  echo "$1: $n requests of $gen tokens, $(( $(stat -c %s $t) / 1024 )) KiB, at $(elapsed) s"
}
kept=""
for spec in chat:$CHAT_PROMPTS math:$MATH_PROMPTS code:$CODE_PROMPTS; do
  w=${spec%%:*}; record $w $w ${spec##*:} && kept="$kept --trace $w=$OUT/proxy-$w.trace"; pack
done
[ -n "$kept" ] || { echo "no trace recorded"; exit 1; }

timeout $(left 0) python3 benchmarks/proxy_metrics.py --train-log $R/train_log.json $kept \
  --out $R/proxy_metrics.json 2>&1 | tee $OUT/proxy_metrics.txt
pack
for t in $OUT/proxy-*.trace; do     # the locality reports, while time is left (`oled trace --report` prints them)
  timeout $(left 5) python3 -m oled.cli trace --report $t > $R/$(basename $t .trace).locality.txt 2>&1
done
if [ "${GRID_AFTER:-1}" = 1 ] && [ -f $OUT/proxy-chat.trace ] && [ $(left 0) -gt 60 ]; then
  timeout $(left 5) python3 -m oled.cli bench --routing $OUT/proxy-chat.trace --random-weights llada2-mini \
    --policies ${GRID_POLICIES:-full,lru,lfu,tide,oled,oled-retain} --budgets ${GRID_BUDGETS:-1.0,0.4,0.25} \
    --prompts ${GRID_PROMPTS:-1} --repeats 1 --warmup 1 --no-profile --no-progress --out $R/routing-grid \
    > $R/routing-grid.log 2>&1; echo "routing grid rc=$? at $(elapsed) s"; tail -3 $R/routing-grid.log
  cp $R/routing-grid/results.jsonl $OUT/routing-grid-results.jsonl 2>/dev/null
fi
echo "done at $(elapsed) s"; pack; ls -la $OUT
