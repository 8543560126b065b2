"""Where an eager decode iteration's time goes on the GPU: torch.profiler over one generation, plus the grouped expert
GEMM timed alone on the layer's slot pool (strided views) against the same weights made contiguous.

    python benchmarks/profile_forward.py [LAYERS] [POLICY] [BUDGET]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import oled
from oled.runtime.grouped import grouped_swiglu

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
policy = sys.argv[2] if len(sys.argv) > 2 else "full"
budget = sys.argv[3] if len(sys.argv) > 3 else "1.0"
llm = oled.LLM(random_weights="llada2-mini", layers=layers, policy=policy, expert_budget=budget,
               cuda_graphs=False)                       # the eager forward: what graphs replace
prompt = "def quicksort(items):"
llm.generate(prompt, gen_length=64)
torch.cuda.synchronize()
t = time.perf_counter()
out = llm.generate(prompt, gen_length=64)
torch.cuda.synchronize()
wall = time.perf_counter() - t
nfe = out.counters["nfe"]
print(f"{policy} {budget}: {wall * 1e3:.1f} ms for nfe {nfe} -> {wall / nfe * 1e3:.2f} ms per forward "
      f"({layers} layers)", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt, gen_length=64)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))

m = llm.engine.manager
pool = m.cache.pool[: m.cache.capacity]
H, I = m.hidden, m.inter
for T in (32, 64):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, m.cache.capacity, (T * 8,), device="cuda")
    toks = torch.arange(T * 8, device="cuda") // 8
    for name, p in (("pool view", pool), ("contiguous copy", pool.clone())):
        for _ in range(3):
            grouped_swiglu(x, toks, ids, p, H, I)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(20):
            grouped_swiglu(x, toks, ids, p, H, I)
        e.record()
        e.synchronize()
        print(f"grouped_swiglu T={T} {name}: {s.elapsed_time(e) / 20 * 1e3:.0f} us", flush=True)
