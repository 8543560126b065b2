"""Why CPU-computed experts change bf16 tokens: the GPU path rounds gate/up and the activation to bf16, the CPU kernel
accumulates and keeps intermediates in fp32. Both against an fp32 computation from the same bf16 weights and inputs
(LLaDA2.0-mini expert shape, random weights).   python benchmarks/bf16_rounding.py"""
import torch
from oled.runtime.cpu_kernel import CpuExpertKernel
from oled.runtime.grouped import grouped_swiglu
torch.manual_seed(0)
H, I, E, T = 2048, 512, 4, 8
w = (torch.randn(E, 3 * I * H) * 0.02).to(torch.bfloat16)
x = torch.randn(T * E, H).to(torch.bfloat16)
tok = torch.arange(T * E)
slots = torch.arange(T * E) // T
# fp32 reference from the same bf16 inputs
def ref_one(xx, blob):
    g = blob[: I * H].view(I, H).float(); u = blob[I * H: 2 * I * H].view(I, H).float(); d = blob[2 * I * H:].view(H, I).float()
    return (torch.nn.functional.silu(xx.float() @ g.t()) * (xx.float() @ u.t())) @ d.t()
ref = torch.cat([ref_one(x[e*T:(e+1)*T], w[e]) for e in range(E)])
order, y = grouped_swiglu(x, tok, slots, w, H, I)
gpu_style = torch.empty_like(y); gpu_style[order] = y
k = CpuExpertKernel()
out = torch.empty(T * E, H)
k.run(x, tok, torch.arange(0, T * E + 1, T), [w[e] for e in range(E)], I, out)
rel = lambda a: ((a.float() - ref).norm() / ref.norm()).item()
print(f"bf16 grouped (GPU path, bf16 intermediates): rel err {rel(gpu_style):.2e}")
print(f"CPU kernel (fp32 accumulate), fp32 out:        rel err {rel(out):.2e}")
print(f"CPU kernel cast to bf16 (as combined):         rel err {rel(out.to(torch.bfloat16)):.2e}")
print(f"GPU path vs CPU kernel:                        rel diff {((gpu_style.float()-out).norm()/out.norm()).item():.2e}")
