"""Whether the optional Triton kernels can run here, and whether a given kernel runs compiled or interpreted.

Triton is an optional dependency: this module imports it only inside the functions, so `import oled` (and this
module) work without it. Triton decides compiled vs interpreted when a function is decorated: its own library at
`import triton`, our kernels when their modules are first imported. So TRITON_INTERPRET=1 must be set before
Triton is first imported, and the launchers ask the kernel object itself rather than the environment.
"""
from __future__ import annotations

import functools
import os

import torch


def available() -> bool:
    """Triton importable, and either a CUDA device to compile for or Triton's CPU interpreter switched on
    (TRITON_INTERPRET=1, read the way Triton reads it)."""
    try:
        import triton
    except ImportError:
        return False
    try:
        interpret = bool(triton.knobs.runtime.interpret)
    except AttributeError:          # Triton before knobs (< 3.4): the plain environment variable
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return interpret or torch.cuda.is_available()


def interpreted(kernel) -> bool:
    """True for a kernel that Triton's interpreter runs (numpy on the host), False for a compiled one."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_device(kernel, *tensors: torch.Tensor) -> None:
    """A compiled kernel needs CUDA tensors; the interpreter takes tensors on any device."""
    if interpreted(kernel):
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(f"compiled Triton kernels need CUDA tensors, got one on {t.device} "
                             "(set TRITON_INTERPRET=1 before importing the kernels to run them on the CPU)")


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The CUDA device's multiprocessor count, asked once per device (launchers that size their grids by it run
    every forward)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
