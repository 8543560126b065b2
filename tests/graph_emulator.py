"""CUDA-graph semantics on the CPU, for testing oled/decoding/graphs.py without a GPU.

A capture records the tensor operations of a code region (running them too, which CUDA does not); a replay reruns
exactly those operations on the same tensors and writes each result into the tensor the capture produced, as a
CUDA graph writes into its static buffers. Python code between the operations does not run on replay, so anything
a replay depends on that is not a recorded operation (a value computed on the host, a tensor made from NumPy)
comes out stale, and the tests comparing replays with eager forwards fail. Reading a tensor's value on the host
while capturing raises, as it does under CUDA capture.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {torch.ops.aten._local_scalar_dense.default}


class EmulatedGraphs:
    """fail_capture: False; True, a capture that cannot begin; "during", one whose first operation fails (as a cuBLAS
    call that must create its handle does under CUDA capture)."""

    def __init__(self, fail_capture: bool | str = False):
        self.fail_capture = fail_capture
        self.segments = self.released = 0
        self.open = None                # the recording under way
        self.left_open = 0              # captures still open when the capturing region ended

    @contextlib.contextmanager
    def capturing(self):
        # under CUDA, leaving the capture stream with a capture open fails, and so does every launch after it: the
        # emulator counts it, so a test can require that a failed capture is ended inside the region
        try:
            yield
        finally:
            if self.open is not None:
                self.left_open += 1

    def new_graph(self, share_with=None):
        self.segments += 1
        return _Recording(self)


class _Recording:
    def __init__(self, owner: EmulatedGraphs):
        self.owner = owner
        self.ops: list = []
        self.mode = None

    def begin(self):
        if self.owner.fail_capture is True:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.mode = _Recorder(self.ops, fail=self.owner.fail_capture == "during")
        self.mode.__enter__()
        self.owner.open = self

    def end(self):
        self.mode.__exit__(None, None, None)
        self.owner.open = None

    def replay(self):
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                res = func(*args, **kwargs)
                if out is not None:
                    for dst, src in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                        if isinstance(dst, torch.Tensor):
                            dst.copy_(src)

    def release(self):
        self.owner.released += 1
        self.ops.clear()


class _Recorder(TorchDispatchMode):
    def __init__(self, ops, fail: bool = False):
        super().__init__()
        self.ops, self.fail = ops, fail

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.fail:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")
        if func in HOST_READS:
            raise RuntimeError("operation not permitted when stream is capturing (a host read)")
        out = func(*args, **kwargs)
        if func.is_view and _aliases(out, args[0]):
            return out                       # a view of its input: the captured view stays valid
        # (reshape and the like are declared as views but copy when they must: those are recorded)
        # in-place and out= operations rerun on their arguments; the others write into the captured outputs
        self.ops.append((func, args, kwargs, None if func._schema.is_mutable else out))
        return out


def _aliases(out, base) -> bool:
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return isinstance(base, torch.Tensor) and all(
        t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for t in outs)
