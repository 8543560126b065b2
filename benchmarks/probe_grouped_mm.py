"""One-off probe: does torch._grouped_mm accept strided slot-pool views on this GPU, and how fast is it?"""
import torch, time, subprocess
print(torch.__version__, torch.cuda.get_device_name(), torch.version.cuda)
dev = "cuda"
H, I, S = 2048, 512, 512
pool = torch.randn(S, 3 * I * H, device=dev, dtype=torch.bfloat16) * 0.02
gate_up = pool[:, : 2 * I * H].view(S, 2 * I, H)
down = pool[:, 2 * I * H :].view(S, H, I)
for n_active, tok in [(28, 8), (70, 4), (256, 1)]:
    slots = torch.randperm(S, device=dev)[:n_active]
    counts = torch.zeros(S, dtype=torch.int32, device=dev)
    counts[slots] = tok
    offs = counts.cumsum(0).to(torch.int32)
    T = n_active * tok
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    try:
        def f():
            h = torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offs)
            g, u = h.chunk(2, dim=-1)
            a = torch.nn.functional.silu(g) * u
            return torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
        y = f()
        # reference
        ref = []
        order = torch.argsort(slots)
        s_sorted = slots[order]
        r0 = 0
        for s in s_sorted.tolist():
            xs = x[r0 : r0 + tok].float(); r0 += tok
            gu = xs @ gate_up[s].float().T
            g, u = gu.chunk(2, -1)
            ref.append((torch.nn.functional.silu(g) * u) @ down[s].float().T)
        ref = torch.cat(ref)
        err = (y.float() - ref).norm() / ref.norm()
        for _ in range(5): f()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(50): f()
        e1.record(); torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / 50
        gb = n_active * 3 * I * H * 2 / 1e9
        print(f"active={n_active} tok={tok} relerr={err:.2e} {ms*1e3:.1f}us {gb/ms*1e3:.0f} GB/s")
    except Exception as e:
        print("FAIL", n_active, tok, repr(e)[:300])
# fp32 grouped mm on cuda?
try:
    xf = torch.randn(16, 64, device=dev); wf = torch.randn(4, 32, 64, device=dev)
    o = torch._grouped_mm(xf, wf.transpose(-2, -1), offs=torch.tensor([4, 8, 12, 16], device=dev, dtype=torch.int32))
    print("fp32 grouped_mm ok", o.shape)
except Exception as e:
    print("fp32 grouped_mm FAIL", repr(e)[:200])
# pinned H2D bandwidth
src = torch.empty(64 * 3 * I * H, dtype=torch.bfloat16).pin_memory()
dst = torch.empty_like(src, device=dev)
for _ in range(3): dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
print(f"pinned H2D {src.numel()*2/dt/1e9:.1f} GB/s")
print(subprocess.run("lscpu | grep -E 'Model name|^CPU\\(s\\)|Thread|Socket|L3'; grep -o -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort | uniq -c; which gcc cc g++ ninja; gcc --version | head -1; nproc", shell=True, capture_output=True, text=True).stdout)
