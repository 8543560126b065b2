#!/usr/bin/env bash
# One H200 call: the policy grid (DESIGN.md section 8 default grid), then the engine-core benchmark with a routing
# trace, its locality report and the cost model (one model build each), then the grid on the trained tiny model. Every stage has a time limit, so one slow stage cannot take
# the others' results with it; partial grid rows are still rendered.
#   GRID_S / CORE_S / TINY_S: stage limits in seconds.   Results: $OUT/results.tgz (and the tails of the logs on stdout)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; R=$OUT/res; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)";
  python3 -c "import torch; print('torch', torch.__version__)"; git rev-parse HEAD 2>/dev/null; } > $R/hardware.txt
cat $R/hardware.txt
python3 -m oled.cli synth --help > /dev/null || { echo "oled does not import"; exit 1; }
timeout ${GRID_S:-330} python3 -m oled.cli bench --random-weights llada2-mini \
  --policies full,lru,lfu,prefetch,fiddler,tide --budgets 1.0,0.6,0.4,0.25 --workload code --prompts 1 \
  --gen-length 256 --block-length 32 --threshold 0.95 --repeats 3 --no-progress --out $R/grid > $R/grid.log 2>&1
echo "grid rc=$?"; tail -5 $R/grid.log
python3 -m oled.cli bench --render $R/grid >> $R/grid.log 2>&1
timeout ${CORE_S:-150} python3 benchmarks/core_bench.py --random-weights llada2-mini --gen-length 256 --repeats 3 \
  --out $R/core_mini.json --trace $R/mini.trace --costs > $R/core.log 2>&1; echo "core rc=$?"; tail -60 $R/core.log
# the project's trained tiny model: real learned routing (small experts, so timings are launch-bound)
timeout ${TINY_S:-120} python3 -m oled.cli bench --policies full,lru,lfu,prefetch,fiddler,tide \
  --budgets 1.0,0.6,0.4,0.25 --workload code --prompts 4 --gen-length 128 --repeats 3 --no-progress \
  --out $R/tiny-grid > $R/tiny-grid.log 2>&1; echo "tiny grid rc=$?"; tail -3 $R/tiny-grid.log
python3 -m oled.cli bench --render $R/tiny-grid >> $R/tiny-grid.log 2>&1
tar czf $OUT/results.tgz -C $OUT res && ls -la $OUT
