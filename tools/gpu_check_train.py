"""Device check for the tiny trainer: grouped-GEMM MoE (bf16, autograd) equals the per-expert loop on CUDA, and a
timing of one training step for a few batch shapes. Usage: PYTHONPATH=. python tools/gpu_check_train.py"""
import time

import torch

from oled.train.diffusion import bd_loss
from oled.train.model import LLaDA2MoeModelLM, TinyConfig, bd_attention_mask
from oled.train.tiny import DEFAULT_MODEL

dev = "cuda"
print(torch.__version__, torch.cuda.get_device_name(), flush=True)
c = TinyConfig(**DEFAULT_MODEL)
m = LLaDA2MoeModelLM(c).to(dev)
moe = m.moe_layers()[0]
x = torch.randn(4096, c.hidden_size, device=dev, requires_grad=True)
outs, grads = [], []
for grouped in (True, False):
    moe.experts.grouped = grouped
    x.grad = None
    moe.experts.gate_up.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = moe(x)
    y.float().pow(2).mean().backward()
    outs.append(y.float())
    grads.append((x.grad.clone(), moe.experts.gate_up.grad.clone()))
moe.experts.grouped = True
print("grouped vs loop: out", (outs[0] - outs[1]).abs().max().item(), "scale", outs[1].abs().max().item(),
      "| dx", (grads[0][0] - grads[1][0]).abs().max().item(), "| dW", (grads[0][1] - grads[1][1]).abs().max().item(),
      "scale", grads[1][1].abs().max().item(), flush=True)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
for B, L in ((64, 1024), (128, 512)):
    x0 = torch.randint(5, c.vocab_size, (B, L), device=dev)
    am = bd_attention_mask(L, 32, dev)
    for i in range(6):
        if i == 3:
            torch.cuda.synchronize(); t = time.time()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = bd_loss(m, x0, mask_id=1, block_length=32, attn_mask=am)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = (time.time() - t) / 3
    print(f"B={B} L={L}: {dt * 1e3:.1f} ms/step, {B * L / dt / 1e3:.0f}k clean tok/s, "
          f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    torch.cuda.reset_peak_memory_stats()
