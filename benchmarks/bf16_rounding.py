"""Why CPU-computed experts change bf16 tokens: the GPU path rounds gate/up and the activation to bf16, the CPU
kernel accumulates and keeps intermediates in fp32. Both against an fp32 computation from the same bf16 weights and
inputs (LLaDA2.0-mini expert shape, random weights).   python benchmarks/bf16_rounding.py"""
import torch
import torch.nn.functional as F

from oled.runtime.cpu_kernel import CpuExpertKernel
from oled.runtime.grouped import grouped_swiglu

torch.manual_seed(0)
H, I, E, T = 2048, 512, 4, 8                     # hidden, expert intermediate, experts, tokens per expert
w = (torch.randn(E, 3 * I * H) * 0.02).to(torch.bfloat16)
x = torch.randn(T * E, H).to(torch.bfloat16)
tokens = torch.arange(T * E)
slots = torch.arange(T * E) // T


def fp32_expert(xx, blob):
    gate, up, down = blob.float().split([I * H, I * H, H * I])
    xx = xx.float()
    return (F.silu(xx @ gate.view(I, H).t()) * (xx @ up.view(I, H).t())) @ down.view(H, I).t()


ref = torch.cat([fp32_expert(x[e * T:(e + 1) * T], w[e]) for e in range(E)])
order, y = grouped_swiglu(x, tokens, slots, w, H, I)
gpu_path = torch.empty_like(y)
gpu_path[order] = y
cpu_path = torch.empty(T * E, H)
CpuExpertKernel().run(x, tokens, torch.arange(0, T * E + 1, T), [w[e] for e in range(E)], I, cpu_path)


def rel(a, b=ref):
    return ((a.float() - b).norm() / b.norm()).item()


print(f"bf16 grouped (GPU path, bf16 intermediates): rel err {rel(gpu_path):.2e}")
print(f"CPU kernel (fp32 accumulate), fp32 out:        rel err {rel(cpu_path):.2e}")
print(f"CPU kernel cast to bf16 (as combined):         rel err {rel(cpu_path.to(torch.bfloat16)):.2e}")
print(f"GPU path vs CPU kernel:                        rel diff {rel(gpu_path, cpu_path):.2e}")
