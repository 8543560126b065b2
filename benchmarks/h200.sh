#!/usr/bin/env bash
# H200 benchmarks in stages, each under its own time limit so one slow stage cannot take the others' results with it:
#   smoke  CUDA-path check on a 4-layer mini-shaped model: graph replays vs eager, every policy kind, with the engine's
#          default kernels (the Triton ones, on CUDA; SMOKE_ARGS=plain: torch's, fused: every Triton kernel asked for)
#   wake   A/B of the CPU workers' wake modes (--cpu-wake layer|forward|off) on the CPU-using policies at 25 %;
#          the fastest (sum of TPOT medians) is exported to the later stages of the call
#   grid   the default policy grid on llada2-mini shapes, one `oled bench` command: every baseline, oled and its
#          ablations at 100/60/40/25 %, belady's bound beside them (GRID_POLICIES narrows it); with GRID_REF (a
#          committed grid's folder) compared with it cell by cell (benchmarks/compare_grids.py; TINY_REF and
#          ROUTING_REF do the same for the tiny and routing stages)
#   trace  `oled trace` on llada2-mini shapes: routing trace and its locality report
#   core   engine-core benchmark (issue 2) with a routing trace, its locality report and the measured cost model
#   tiny   the same policy grid on the project's trained tiny model (real learned routing)
#   routing  the policy grid on llada2-mini shapes driven by the routing proxy's trace (learned routing replayed at
#          real expert sizes, `oled bench --routing`; ROUTING_TRACE picks the trace). Every request of the trace is
#          replayed (ROUTING_PROMPTS=N: a sample of the first N, which the results state); a call's 10 minutes hold
#          the whole grid of one request only, so narrow ROUTING_POLICIES or GRID_BUDGETS per call
#   fused  `full` and `lru` (FUSED_POLICIES) at 100/40 % with torch's kernels (--no-fused) and with FUSED_FLAG
#          (default --fused: every Triton kernel), back to back
#   kernels  the Triton kernels against their torch references at llada2-mini shapes (benchmarks/kernels_bench.py;
#          KERNELS_CASES picks cases; the fused-MoE kernels at KERNEL_TILES' configurations too, when given; the
#          attention kernel at ATTENTION_TILES' configurations, e.g. "rows=16 rows=64,block_n=32", when given; the
#          skinny GEMM at LINEAR_TILES' besides its defaults, e.g. "block_n=32 block_k=128,stages=3")
#   overhead  where a forward's time goes: wall, GPU kernel time, launches, the kernels by GPU time, the floor from the
#          weights touched, host steps, for full, lru and oled (benchmarks/offload_overhead.py; OVERHEAD_RUNS picks
#          POLICY@BUDGET runs, OVERHEAD_MODES picks "fused" (the Triton kernels) and/or "plain" (torch's);
#          OVERHEAD_PROMPT="--workload code --gen-length 256" profiles the default grid's request)
#   ttft   time to first token and prefill per budget for prompts of 32, 512 and 2,048 tokens against the PCIe floor
#          (benchmarks/ttft.py; the engine's default kernels, TTFT_FLAGS=--no-fused for torch's)
#   capture  --capture-slots A/B (CAPTURE_SLOTS, default "0 4"): lru, oled and oled-retain at 60 / 40 % on the default
#          grid's settings, and lru and oled on the routing proxy's trace (CAPTURE_ROUTING=0 skips that part)
#   graph-probe  the host's launch time of CUDA graphs of small kernels with and without the mapped forward's
#          read-back nodes (D2H copies into pinned buffers, external event records; benchmarks/graph_launch_probe.py)
#   gaps   per denoising forward, the GPU's time in the forward against its idle gap before the next, for GAPS_RUNS
#          (default full@1.0,oled@0.4; benchmarks/forward_gaps.py, the default grid's request), then (GAPS_FLAGS,
#          default --profile) the iterations' kernels per forward under torch.profiler, prefill left out
#   gaps-ab  forward_gaps.py's runs (GAPS_RUNS) at the working tree and at AB_REF (default HEAD) in a worktree,
#          alternating (AB_ROUNDS rounds), on the default grid's request and on the routing proxy's trace (AB_ROUTING=0:
#          the default request only): a host-side change's effect on the forward and its gap, measured in one process
#          pair each
#   house-ab  the default grid (GRID_POLICIES, GRID_BUDGETS) and the routing grid on the proxy's first request
#          (HOUSE_ROUTING_POLICIES, HOUSE_ROUTING_BUDGETS) at AB_REF (a commit, checked out in a worktree) and at the
#          working tree, in one call, each pair compared cell by cell (benchmarks/compare_grids.py): a restructuring
#          that must change no byte moved and no time beyond the run-to-run spread
#   policy-step  each policy's host step per MoE layer replayed from the routing trace on this host's CPU, alone and
#          beside the CPU kernel's polling workers (benchmarks/policy_step_cost.py)
#   order  the bundled model at 100 % with ORDER_POLICIES (default full,oled,full,lru,oled-retain,full) in one
#          `oled bench`, in run order: whether a cell's time depends on the cells run before it in the process
#   flag   how long a kernel takes to see a mark the host stores in pinned memory, and what a CUDA graph of 19
#          layers pays when each waits for the CPU kernel's rows (benchmarks/host_flag_probe.py; FLAG_ARGS adds flags)
#   fp8    bf16 against FP8 experts (--expert-dtype) side by side on llada2-mini at 40 / 25 %: the default grid's
#          request (FP8_PARTS "grid") and the routing proxy's trace (FP8_PARTS "routing"), FP8_POLICIES, each part one
#          `oled bench` per expert dtype (FP8_S each), then TPOT and bytes an iteration per cell, bf16 beside FP8.
#          Expected: about 150 s a dtype for "grid", 170 s a dtype for "routing" (3 requests), so one part a call
#   flash  LLaDA2.0-flash, every layer, FP8 experts (93.2 GiB host, pinned as 96 GiB), one `oled bench` at
#          FLASH_BUDGETS (default 40 / 25 %, 100 % too where the GPU holds every expert, e.g. an H200) with
#          FLASH_POLICIES: TPOT, prefill, misses and bytes an iteration, the bound rows (the PCIe floor of the misses),
#          load time (random weights made, quantised and pinned) and peak host / GPU memory (the result lines'
#          model.load_seconds, memory; nvidia-smi's peak beside). Expected: 2-4 min load, about 5-8 min in all
#   numerics  `oled compare` on the bundled model in bf16: teacher-forced logits (largest and mean difference, argmax
#          agreement) and free-run tokens against full (every expert resident) of oled with the CPU share at 40 %, and
#          of FP8 experts (all resident) where the engine has the expert_dtype setting; NUMERICS_MINI=1 adds the same
#          on random llada2-mini weights (NUMERICS_MINI_LAYERS layers, default 4). One JSON each under $OUT
#   busy   the README's main job on two of the host's cores (taskset) with both busy, against idle
#          (benchmarks/busy_cores.py, --device cpu: the 2-core machine of issue 16)
# The routing proxy itself is trained and traced by benchmarks/routing_proxy.sh (its own call).
# STAGES picks stages (default: all; the 10-minute limit per call needs e.g. "smoke", "grid", "trace core tiny").
# GRID_FLAGS adds engine flags to every `oled bench` of the call (e.g. --no-fused: torch's kernels, not the Triton
# ones the engine runs by default on CUDA).
# If the smoke check finds graph replays changing tokens, later stages of the call run with --no-cuda-graphs; if it
# finds segmented graphs of offloaded forwards changing tokens, with --no-offload-graphs. GRAPHS=... overrides.
# Results: $OUT/results-<stages>.tgz, each bench stage's result lines as $OUT/<folder>-results.jsonl, and the tails
# of the logs on stdout.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/res; mkdir -p $R
STAGES=${STAGES:-smoke grid trace core tiny}
has() { [[ " $STAGES " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)";
  python3 -c "import torch; print('torch', torch.__version__)"; git rev-parse HEAD 2>/dev/null; } > $R/hardware.txt
cat $R/hardware.txt
python3 -m oled.cli synth --help > /dev/null || { echo "oled does not import"; exit 1; }
pack() { tar czf "$OUT/results-${STAGES// /-}.tgz" -C $OUT res; ls -la $OUT; }
# a bench stage's result lines at the top of $OUT as soon as it ends: a call that runs out of time while rendering or
# packing still brings them back (a finished 41-run grid was lost that way)
keep() { for d in "$@"; do [ -f "$R/$d/results.jsonl" ] && cp "$R/$d/results.jsonl" "$OUT/$d-results.jsonl"; done; }
# a bench stage's grid against a committed one (its folder REF, when given), cell by cell, and the OLED targets
compare_to() { [ -n "$1" ] || return 0; python3 benchmarks/compare_grids.py "$1" $R/$2 --json $R/$2-compare.json 2>&1 |
  tee $R/$2-compare.txt; }
GRAPHS=${GRAPHS:-}
# every baseline, the planner's own (no credit), OLED and its ablations; `oled bench` adds the belady bound rows
ALL_POLICIES=full,lru,lfu,prefetch,fiddler,tide,lru:misses=cooperative,oled,oled-retain,oled-coop
if has smoke; then
  timeout ${SMOKE_S:-150} python3 benchmarks/h200_smoke.py 4 llada2-mini ${SMOKE_ARGS:-} > $R/smoke.log 2>&1; rc=$?
  echo "smoke rc=$rc"
  tail -30 $R/smoke.log
  [ $rc -eq 2 ] && GRAPHS=--no-cuda-graphs
  [ $rc -eq 3 ] && GRAPHS=--no-offload-graphs
fi
GRID="--random-weights llada2-mini --budgets ${GRID_BUDGETS:-1.0,0.6,0.4,0.25} --workload code --prompts 1 --gen-length 256
      --block-length 32 --threshold 0.95 --repeats 3 --no-progress $GRAPHS ${GRID_FLAGS:-}"
if has wake; then
  best=""; best_ms=""
  for mode in ${WAKE_MODES:-layer forward off}; do
    timeout ${WAKE_S:-150} python3 -m oled.cli bench $GRID --cpu-wake $mode --budgets 0.25 \
      --policies fiddler,tide,lru:misses=cooperative --no-profile --out $R/wake-$mode > $R/wake-$mode.log 2>&1
    ms=$(python3 -c "import json,sys; print(sum(json.loads(l)['metrics']['tpot_ms']['median'] for l in open(sys.argv[1])))" \
         $R/wake-$mode/results.jsonl 2>/dev/null)
    echo "wake $mode: sum of TPOT medians ${ms:-failed} ms"
    if [ -n "$ms" ] && { [ -z "$best" ] || python3 -c "import sys; sys.exit(not $ms < $best_ms)"; }; then best=$mode; best_ms=$ms; fi
  done
  [ -n "$best" ] && GRID="$GRID --cpu-wake $best" && echo "later stages: --cpu-wake $best"
fi
if has grid; then
  start=$(date +%s)
  timeout ${GRID_S:-570} python3 -m oled.cli bench $GRID --policies ${GRID_POLICIES:-$ALL_POLICIES} \
    --out $R/grid > $R/grid.log 2>&1
  echo "grid rc=$? in $(( $(date +%s) - start )) s"; tail -3 $R/grid.log; keep grid
  compare_to "${GRID_REF:-}" grid
fi
if has trace; then
  timeout ${TRACE_S:-200} python3 -m oled.cli trace --random-weights llada2-mini --workload code --prompts 1 \
    --gen-length 256 --block-length 32 --threshold 0.95 $GRAPHS --out $R/mini.trace --json $R/mini.trace.locality.json \
    > $R/trace.log 2>&1; echo "trace rc=$?"; tail -40 $R/trace.log
fi
if has core; then
  timeout ${CORE_S:-240} python3 benchmarks/core_bench.py --random-weights llada2-mini --gen-length 256 --repeats 3 \
    --out $R/core_mini.json --trace $R/mini.trace --costs > $R/core.log 2>&1; echo "core rc=$?"; tail -60 $R/core.log
fi
if has tiny; then
  timeout ${TINY_S:-300} python3 -m oled.cli bench --policies ${TINY_POLICIES:-$ALL_POLICIES} \
    --budgets 1.0,0.6,0.4,0.25 --workload code --prompts ${TINY_PROMPTS:-2} --gen-length 128 --repeats 2 --no-progress $GRAPHS \
    --out $R/tiny-grid > $R/tiny-grid.log 2>&1; echo "tiny grid rc=$?"; tail -3 $R/tiny-grid.log
  python3 -m oled.cli bench --render $R/tiny-grid >> $R/tiny-grid.log 2>&1
  compare_to "${TINY_REF:-}" tiny-grid
fi
if has routing; then
  start=$(date +%s)
  timeout ${ROUTING_S:-540} python3 -m oled.cli bench --routing ${ROUTING_TRACE:-benchmarks/traces/proxy-chat.trace} \
    --random-weights llada2-mini --policies ${ROUTING_POLICIES:-$ALL_POLICIES,oled:waves=1} \
    --budgets ${GRID_BUDGETS:-1.0,0.6,0.4,0.25} \
    ${ROUTING_PROMPTS:+--prompts $ROUTING_PROMPTS} --repeats ${ROUTING_REPEATS:-1} --warmup 1 --no-profile --no-progress $GRAPHS \
    ${ROUTING_FLAGS:-} --out $R/${ROUTING_OUT:-routing-grid} > $R/${ROUTING_OUT:-routing-grid}.log 2>&1
  echo "routing grid rc=$? in $(( $(date +%s) - start )) s"; tail -3 $R/${ROUTING_OUT:-routing-grid}.log
  keep ${ROUTING_OUT:-routing-grid}
  compare_to "${ROUTING_REF:-}" ${ROUTING_OUT:-routing-grid}
fi
if has capture; then
  for slots in ${CAPTURE_SLOTS:-0 4}; do
    timeout ${CAPTURE_S:-120} python3 -m oled.cli bench $GRID --budgets 0.6,0.4 --policies ${CAPTURE_POLICIES:-lru,oled,oled-retain} \
      --no-bound --capture-slots $slots --out $R/capture-$slots > $R/capture-$slots.log 2>&1
    echo "capture $slots rc=$?"; keep capture-$slots
    if [ "${CAPTURE_ROUTING:-1}" = 1 ]; then
      timeout ${CAPTURE_S:-120} python3 -m oled.cli bench --routing ${ROUTING_TRACE:-benchmarks/traces/proxy-chat.trace} \
        --random-weights llada2-mini --policies lru,oled --budgets 0.6,0.4 --repeats 1 --warmup 1 \
        --no-profile --no-progress --no-bound $GRAPHS --capture-slots $slots --out $R/capture-routing-$slots \
        > $R/capture-routing-$slots.log 2>&1
      echo "capture routing $slots rc=$?"; keep capture-routing-$slots
    fi
  done
  python3 - $R/capture-* <<'PY'
import json, os, sys
for d in filter(os.path.isdir, sys.argv[1:]):
    for line in open(f"{d}/results.jsonl"):
        r = json.loads(line)
        m = r["metrics"]
        print(d.rsplit("/", 1)[-1], r["policy_label"], r["budget"], "TPOT ms %.3f" % m["tpot_ms"]["median"],
              "ms/fwd %.2f" % m["ms_per_forward"]["median"], "H2D GB/iter %.3f" % m["h2d_gb_per_iteration"]["median"],
              "mapped GB/iter %.3f" % m["mapped_gb_per_iteration"]["median"],
              "captured/iter %.1f" % (m.get("captured_experts_per_iteration") or {}).get("median", 0),
              "agreement", m["token_agreement"]["median"])
PY
fi
if has graph-probe; then
  timeout ${PROBE_S:-120} python3 benchmarks/graph_launch_probe.py --out $R/graph_launch.jsonl > $R/graph-probe.log 2>&1
  echo "graph-probe rc=$?"; cat $R/graph-probe.log; cp $R/graph_launch.jsonl $OUT/ 2>/dev/null
fi
if has gaps; then
  timeout ${GAPS_S:-150} python3 benchmarks/forward_gaps.py --runs ${GAPS_RUNS:-full@1.0,oled@0.4} ${GAPS_FLAGS:---profile} \
    --out $R/forward_gaps.json > $R/gaps.log 2>&1
  echo "gaps rc=$?"; tail -${GAPS_TAIL:-80} $R/gaps.log; cp $R/forward_gaps.json $OUT/ 2>/dev/null
fi
if has gaps-ab; then
  # the same forward_gaps runs at the working tree and at AB_REF (a commit, checked out in a worktree), alternating
  # AB_ROUNDS times, on the default grid's request and (AB_ROUTING=0 skips it) on the routing proxy's trace
  git worktree add -f /tmp/ab-ref ${AB_REF:-HEAD} > /dev/null 2>&1 || { echo "gaps-ab: no worktree of ${AB_REF:-HEAD}"; }
  for round in $(seq ${AB_ROUNDS:-1}); do
    for request in default $([ "${AB_ROUTING:-1}" = 1 ] && echo routing); do
      flags=""; [ $request = routing ] && flags="--routing $PWD/${ROUTING_TRACE:-benchmarks/traces/proxy-chat.trace}"
      for side in ref tree; do
        dir=$PWD; [ $side = ref ] && dir=/tmp/ab-ref
        ( cd $dir && PYTHONPATH=$dir timeout ${AB_S:-120} python3 benchmarks/forward_gaps.py \
            --runs ${GAPS_RUNS:-full@1.0,oled@0.4} $flags --out $R/gaps-$request-$side-$round.json ) \
          > $R/gaps-$request-$side-$round.log 2>&1
        echo "gaps-ab $request $side round $round rc=$?"; grep '^{' $R/gaps-$request-$side-$round.log | cut -c1-400
      done
    done
  done
fi
if has house-ab; then
  # AB_DIR: AB_REF's tree exported beforehand (git archive) and carried, for a checkout sent without its history
  ref_dir=${AB_DIR:+$PWD/$AB_DIR}
  [ -n "$ref_dir" ] || { ref_dir=/tmp/house-ref; git worktree add -f $ref_dir ${AB_REF:-HEAD} > /dev/null 2>&1 \
    || echo "house-ab: no worktree of ${AB_REF:-HEAD}"; }
  tree=$PWD         # the trace is the tree's: a subshell's $PWD is the side's folder
  for side in ref tree; do
    dir=$PWD; [ $side = ref ] && dir=$ref_dir
    start=$(date +%s)
    ( cd $dir && PYTHONPATH=$dir timeout ${HOUSE_GRID_S:-200} python3 -m oled.cli bench $GRID \
        --policies ${GRID_POLICIES:-$ALL_POLICIES} --out $R/house-grid-$side ) > $R/house-grid-$side.log 2>&1
    echo "house-ab grid $side rc=$? in $(( $(date +%s) - start )) s"; tail -2 $R/house-grid-$side.log
    start=$(date +%s)
    ( cd $dir && PYTHONPATH=$dir timeout ${HOUSE_ROUTING_S:-120} python3 -m oled.cli bench \
        --routing $tree/${ROUTING_TRACE:-benchmarks/traces/proxy-chat.trace} --random-weights llada2-mini \
        --policies ${HOUSE_ROUTING_POLICIES:-full,lru,lfu,oled,oled-retain} --budgets ${HOUSE_ROUTING_BUDGETS:-1.0,0.4} \
        --prompts ${HOUSE_ROUTING_PROMPTS:-1} \
        --repeats 1 --warmup 1 --no-profile --no-progress $GRAPHS --out $R/house-routing-$side ) \
      > $R/house-routing-$side.log 2>&1
    echo "house-ab routing $side rc=$? in $(( $(date +%s) - start )) s"; tail -2 $R/house-routing-$side.log
    keep house-grid-$side house-routing-$side
  done
  compare_to $R/house-grid-ref house-grid-tree
  compare_to $R/house-routing-ref house-routing-tree
fi
if has policy-step; then
  for workers in "" --polling-workers; do
    timeout ${STEP_S:-120} python3 benchmarks/policy_step_cost.py ${ROUTING_TRACE:-benchmarks/traces/proxy-chat.trace} \
      ${STEP_COSTS:-benchmarks/results/h200/routing-chat-grid-9f25268/results.jsonl.gz} --budget 0.4 \
      --policies lru,oled-retain,oled,oled-coop $workers >> $R/policy-step.log 2>&1; echo "policy-step $workers rc=$?"
  done
  cat $R/policy-step.log
fi
if has flag; then
  timeout ${FLAG_S:-120} python3 benchmarks/host_flag_probe.py ${FLAG_ARGS:-} --out $R/host_flag.json > $R/flag.log 2>&1
  echo "flag rc=$?"; cat $R/flag.log; cp $R/host_flag.json $OUT/ 2>/dev/null
fi
if has order; then
  timeout ${ORDER_S:-120} python3 -m oled.cli bench --policies ${ORDER_POLICIES:-full,oled,full,lru,oled-retain,full} \
    --budgets 1.0 --workload code --prompts 1 --gen-length 128 --repeats ${ORDER_REPEATS:-3} --no-progress --no-bound \
    $GRAPHS ${ORDER_FLAGS:-} --out $R/order > $R/order.log 2>&1; echo "order rc=$?"; keep order
  python3 -c "
import json, sys
for i, l in enumerate(open(sys.argv[1])):
    r = json.loads(l)
    print(i, r['policy_label'], r['budget'], 'TPOT ms %.3f' % r['metrics']['tpot_ms']['median'])" $R/order/results.jsonl
fi
if has fp8; then
  for part in ${FP8_PARTS:-grid routing}; do
    for dt in bf16 fp8; do
      if [ $part = grid ]; then args="$GRID"
      else args="--routing ${ROUTING_TRACE:-benchmarks/traces/proxy-chat.trace} --random-weights llada2-mini
                 --repeats 1 --warmup 1 --no-profile --no-progress $GRAPHS ${ROUTING_PROMPTS:+--prompts $ROUTING_PROMPTS}"
      fi
      start=$(date +%s)
      timeout ${FP8_S:-280} python3 -m oled.cli bench $args --budgets 0.4,0.25 --expert-dtype $dt \
        --policies ${FP8_POLICIES:-lru,lru:misses=cooperative,oled,oled-retain,oled-coop} --out $R/fp8-$part-$dt \
        > $R/fp8-$part-$dt.log 2>&1
      echo "fp8 $part $dt rc=$? in $(( $(date +%s) - start )) s"; tail -2 $R/fp8-$part-$dt.log; keep fp8-$part-$dt
    done
  done
  python3 - $R/fp8-*-bf16 <<'PY'
import json, os, sys
def rows(d):
    out = {}
    for line in open(f"{d}/results.jsonl") if os.path.isfile(f"{d}/results.jsonl") else []:
        r = json.loads(line)
        out[(r["workload"]["name"], r["policy_label"], r["budget"])] = r["metrics"]
    return out
def med(m, key):
    value = (m.get(key) or {}).get("median")
    return float("nan") if value is None else value
for bf16_dir in sys.argv[1:]:
    bf16, fp8 = rows(bf16_dir), rows(bf16_dir[:-len("bf16")] + "fp8")
    print(bf16_dir.rsplit("/", 1)[-1][:-5], "(bf16 | fp8): TPOT ms, H2D GB/iter, mapped GB/iter, agreement with full")
    for key in sorted(set(bf16) | set(fp8)):
        a, b = bf16.get(key, {}), fp8.get(key, {})
        print("  %-24s %-5s TPOT %7.2f | %7.2f  H2D %6.3f | %6.3f  mapped %6.3f | %6.3f  agree %.2f | %.2f" % (
            key[1], key[2], med(a, "tpot_ms"), med(b, "tpot_ms"), med(a, "h2d_gb_per_iteration"),
            med(b, "h2d_gb_per_iteration"), med(a, "mapped_gb_per_iteration"), med(b, "mapped_gb_per_iteration"),
            med(a, "token_agreement"), med(b, "token_agreement")))
PY
fi
if has flash; then
  budgets=${FLASH_BUDGETS:-}
  if [ -z "$budgets" ]; then
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    budgets=0.4,0.25; [ "${gpu_mib:-0}" -gt 120000 ] && budgets=1.0,0.4,0.25     # 93.2 GiB of FP8 experts + dense
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 1000 > $R/flash-gpu-mem.txt 2>/dev/null &
  smi=$!
  start=$(date +%s)
  timeout ${FLASH_S:-540} python3 -m oled.cli bench --random-weights llada2-flash --expert-dtype fp8 --budgets $budgets \
    --policies ${FLASH_POLICIES:-lru,oled} --workload code --prompts 1 --gen-length ${FLASH_GEN:-64} --block-length 32 \
    --threshold 0.95 --repeats 1 --warmup 1 --no-profile --no-progress $GRAPHS ${FLASH_FLAGS:-} --out $R/flash \
    > $R/flash.log 2>&1
  echo "flash rc=$? in $(( $(date +%s) - start )) s"; kill $smi 2>/dev/null; tail -5 $R/flash.log; keep flash
  echo "nvidia-smi peak GPU memory used: $(sort -n $R/flash-gpu-mem.txt | tail -1) MiB"
  python3 - $R/flash/results.jsonl <<'PY'
import json, os, sys
if os.path.isfile(sys.argv[1]):
    said = False
    for line in open(sys.argv[1]):
        r = json.loads(line)
        m, mem = r["metrics"], r.get("memory") or {}
        if not said and "load_seconds" in r.get("model", {}):
            said = True
            print("load %.1f s; after load: host RSS %.1f GiB, GPU %.1f GiB allocated" % (
                r["model"]["load_seconds"], r["model"]["memory_after_load"]["host_peak_rss_bytes"] / 2**30,
                (r["model"]["memory_after_load"]["gpu_peak_allocated_bytes"] or 0) / 2**30))
        med = lambda k: float("nan") if (m.get(k) or {}).get("median") is None else m[k]["median"]    # noqa: E731
        print("%-28s %-5s TPOT %8.2f ms  prefill %8.1f ms  misses/iter %7.1f  H2D %6.3f GB/iter  mapped %6.3f GB/iter"
              "  peak host %.1f GiB GPU %.1f GiB" % (
              r["policy_label"], r["budget"], med("tpot_ms"), med("prefill_ms"), med("misses_per_iteration"),
              med("h2d_gb_per_iteration"), med("mapped_gb_per_iteration"),
              (mem.get("host_peak_rss_bytes") or 0) / 2**30, (mem.get("gpu_peak_allocated_bytes") or 0) / 2**30))
PY
fi
if has numerics; then
  numerics() {      # NAME MODEL-FLAGS CANDIDATE-FLAGS: one `oled compare` against full, its JSON to $OUT
    timeout ${NUMERICS_S:-240} python3 -m oled.cli compare $2 --dtype bfloat16 --workload ${NUMERICS_WORKLOAD:-chat} \
      --prompts ${NUMERICS_PROMPTS:-8} --gen-length ${NUMERICS_GEN:-128} $3 --json $R/numerics-$1.json \
      > $R/numerics-$1.log 2>&1
    echo "numerics $1 rc=$?"; cat $R/numerics-$1.log; cp $R/numerics-$1.json $OUT/ 2>/dev/null
  }
  CPU_SHARE="--candidate policy=oled --candidate cpu_share=true --candidate expert_budget=0.4"
  FP8="--candidate policy=full --candidate expert_dtype=fp8"
  has_fp8=$(python3 -c "from oled.config import SETTING_NAMES; print(int('expert_dtype' in SETTING_NAMES))")
  numerics cpu-share "" "$CPU_SHARE"
  if [ "$has_fp8" = 1 ]; then numerics fp8 "" "$FP8"; else echo "numerics fp8: no expert_dtype setting (skipped)"; fi
  if [ "${NUMERICS_MINI:-0}" = 1 ]; then
    MINI="--random-weights llada2-mini --layers ${NUMERICS_MINI_LAYERS:-4}"
    NUMERICS_PROMPTS=${NUMERICS_PROMPTS:-2} NUMERICS_GEN=${NUMERICS_GEN:-64} numerics mini-cpu-share "$MINI" "$CPU_SHARE"
    [ "$has_fp8" = 1 ] && NUMERICS_PROMPTS=${NUMERICS_PROMPTS:-2} NUMERICS_GEN=${NUMERICS_GEN:-64} \
      numerics mini-fp8 "$MINI" "$FP8"
  fi
fi
if has busy; then
  timeout ${BUSY_S:-240} taskset -c ${BUSY_CPUS:-0,1} python3 benchmarks/busy_cores.py --repeats ${BUSY_REPEATS:-3} \
    --extra --device cpu > $R/busy.log 2>&1; echo "busy rc=$?"; cat $R/busy.log
fi
if has kernels; then
  tiles=""; for t in ${KERNEL_TILES:-}; do
    tiles="$tiles --moe-tiles $t"; done
  attn=""; for t in ${ATTENTION_TILES:-}; do attn="$attn --attention-tiles $t"; done
  for t in ${LINEAR_TILES:-}; do attn="$attn --linear-tiles $t"; done
  timeout ${KERNELS_S:-120} python3 benchmarks/kernels_bench.py ${KERNELS_CASES:+--cases $KERNELS_CASES} $attn \
    --out $R/kernels.jsonl > $R/kernels.log 2>&1
  echo "kernels rc=$?"; tail -40 $R/kernels.log
  if [ -n "${KERNEL_TILES:-}" ]; then
    timeout ${KERNELS_S:-120} python3 benchmarks/kernels_bench.py --cases moe $tiles --out $R/kernels-tiles.jsonl \
      > $R/kernels-tiles.log 2>&1; echo "kernels (tiles) rc=$?"; tail -30 $R/kernels-tiles.log
  fi
fi
if has fused; then
  for mode in ${FUSED_MODES:-plain fused}; do
    flag=--no-fused; [ $mode = fused ] && flag=${FUSED_FLAG:---fused}
    timeout ${FUSED_S:-240} python3 -m oled.cli bench $GRID --budgets ${FUSED_BUDGETS:-1.0,0.4} \
      --policies ${FUSED_POLICIES:-full,lru} --no-bound $flag --out $R/fused-$mode > $R/fused-$mode.log 2>&1
    echo "fused stage ($mode) rc=$?"; keep fused-$mode
  done
  python3 - $R/fused-plain $R/fused-fused <<'PY'
import json, os, sys
for d in filter(os.path.isdir, sys.argv[1:]):
    for line in open(f"{d}/results.jsonl"):
        r = json.loads(line)
        print(d.rsplit("/", 1)[-1], r["policy"], r["budget"], "TPOT ms", r["metrics"]["tpot_ms"]["median"],
              "agreement", r["metrics"]["token_agreement"]["median"])
PY
fi
if has ttft; then
  timeout ${TTFT_S:-300} python3 benchmarks/ttft.py --policy ${TTFT_POLICY:-lru} --budgets ${GRID_BUDGETS:-1.0,0.6,0.4,0.25} \
    --prompt-tokens ${TTFT_PROMPTS:-32,512,2048} --repeats 3 ${TTFT_FLAGS:-} --out $R/ttft.jsonl > $R/ttft.log 2>&1
  echo "ttft rc=$?"; cp $R/ttft.jsonl $OUT/ 2>/dev/null
  python3 -c "
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r['budget'], r['prompt_tokens'], 'prefill %.1f ms (floor %.1f)' % (r['prefill_s'] * 1e3, r['prefill_floor_s'] * 1e3),
          'TTFT %.1f ms (floor %.1f)' % (r['ttft_s'] * 1e3, r['ttft_floor_s'] * 1e3),
          'TTFT / max(floor, 100 %%) %.2f' % r.get('ttft_over_bound', float('nan')),
          'TTFT / (prefill floor + 100 %% first block) %.2f' % r.get('ttft_over_serial_bound', float('nan')),
          'first block %d iterations, %.2f ms each' % (r['first_block_iterations'], r['first_block_ms_per_iteration']))" $R/ttft.jsonl 2>/dev/null
fi
if has overhead; then
  # OVERHEAD_MODES: "fused" (OVERHEAD_FUSED, default --fused: every Triton kernel, the engine's default on CUDA)
  # and/or "plain" (torch's kernels), one JSON each
  for mode in ${OVERHEAD_MODES:-fused plain}; do
    flags=--no-fused; [ $mode = fused ] && flags=${OVERHEAD_FUSED:---fused}
    timeout ${OVERHEAD_S:-330} python3 benchmarks/offload_overhead.py \
      --runs ${OVERHEAD_RUNS:-full@1.0,lru@1.0,lru@0.4,oled-retain@0.4,oled@0.4} ${OVERHEAD_PROMPT:---gen-length 128} $flags \
      --out $R/offload_overhead-$mode.json > $R/overhead-$mode.log 2>&1; echo "overhead ($mode) rc=$?"
    cp $R/offload_overhead-$mode.json $OUT/ 2>/dev/null
    python3 - $R/offload_overhead-$mode.json <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
ref = next((r["token_ids"] for r in runs if r["run"].startswith("full@")), None)
for r in runs:
    if ref is not None:
        print(r["run"], "tokens", "equal to full's" if r["token_ids"] == ref else "DIFFERENT from full's",
              "(the generate with host timers: %s)" % ("the same" if r.get("wrapped_same_tokens", True) else "OTHER"))
    print(r["run"], "wall ms/fwd %.2f gpu %.2f launches %.0f floor %.2f (x%.1f)" % (
        r["wall_ms_per_forward"], r["gpu_kernel_ms_per_forward"], r["kernels_per_forward"],
        r["floor_ms_per_forward"], r["wall_over_floor"] or float("nan")))
    print("   decode alone %.2f ms/fwd, prefill %.1f ms" % (r.get("decode_wall_ms_per_forward", float("nan")),
                                                          r.get("prefill_ms", float("nan"))))
    print("   memcpy ms/fwd %.2f; with the host steps timed %.2f ms/fwd" % (
        r.get("memcpy_ms_per_forward", float("nan")), r.get("wrapped_wall_ms_per_forward", float("nan"))))
    for name, ms in sorted(r["host_ms_per_forward"].items(), key=lambda kv: -kv[1])[:8]:
        print("   host %7.2f ms/fwd  %s" % (ms, name))
    for g in r.get("graph_replay_alone", []):
        print("   graph of %d tokens (%s) replayed alone: launch %.0f us, launch to done %.0f us" % (
            g["tokens"], "mapped" if g["mapped"] else "all-resident", g["launch_us"], g["launch_to_done_us"]))
    for k in r["top_kernels_us_per_forward"][:12]:
        print("   %8.1f us %6.1f x  %s" % (k["us"], k["launches"], k["kernel"]))
PY
  done
fi
for d in grid ${ROUTING_OUT:-routing-grid}; do [ -d $R/$d ] && python3 -m oled.cli bench --render $R/$d >> $R/$d.log 2>&1; done
pack
