"""Host memory: what a model's weights need in RAM, checked against what the machine has before allocating.

Without the check, a model larger than the machine dies in the allocator (or is killed by the OOM killer) after
minutes of work, with no word about the size it needed.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from . import fp8
from .loader import EXPERT_NAME, official_tensors
from .runtime.store import pinned_bytes

MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """Memory that can be allocated without swapping: MemAvailable on Linux (free plus reclaimable page cache),
    else the free pages; None where neither is known."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def weight_bytes(config, dtype: torch.dtype, expert_dtype: str = "bf16") -> tuple[int, int]:
    """(routed-expert bytes, other weight bytes) of the model in `dtype` (tensors published in fp32 stay fp32), the
    routed experts as the store holds them in expert_dtype (fp8: e4m3 weights and their scales, oled/fp8.py)."""
    experts = other = 0
    for name, shape, file_dtype in official_tensors(config):
        itemsize = (file_dtype if file_dtype == torch.float32 else dtype).itemsize
        nbytes = itemsize * torch.Size(shape).numel()
        if EXPERT_NAME.match(name):
            experts += nbytes
        else:
            other += nbytes
    if expert_dtype == "fp8":
        experts = len(config.moe_layers) * config.num_experts * fp8.blob_bytes(config.hidden_size,
                                                                              config.expert_intermediate_size)
    return experts, other


def check_host_memory(config, dtype: torch.dtype, device: torch.device, what: str, expert_dtype: str = "bf16",
                      pin: bool = False) -> None:
    """Refuse, in one line, a model whose host-side weights do not fit in the available memory. The routed experts
    always live on the host (in expert_dtype; pinned, in the store's power-of-two groups of layers); the other
    weights too when the device is the CPU (on CUDA they are made on the device, or streamed there from the
    memory-mapped checkpoint)."""
    experts, other = weight_bytes(config, dtype, expert_dtype)
    layers = len(config.moe_layers)
    held = pinned_bytes(experts // layers, layers) if pin and layers else experts
    need = held + (other if device.type == "cpu" else 0)
    free = available_bytes()
    if free is None or need <= free:
        return
    dtype_name = str(dtype).replace("torch.", "")
    parts = (f"routed experts {experts / 2**30:.1f} GiB{' in fp8' if expert_dtype == 'fp8' else ''}"
             f"{f', {held / 2**30:.1f} GiB pinned' if held != experts else ''}") + (
        f" + other weights {other / 2**30:.1f} GiB" if device.type == "cpu" else "")
    smaller = ["fewer --layers"]
    if dtype.itemsize > torch.bfloat16.itemsize:
        smaller.append("--dtype bfloat16")
    if expert_dtype != "fp8":
        smaller.append("--expert-dtype fp8")
    raise MemoryError(f"{what} needs {need / 2**30:.1f} GiB of host memory in {dtype_name} ({parts}); "
                      f"{free / 2**30:.1f} GiB is available. Use {', '.join(smaller)} or a larger machine")
