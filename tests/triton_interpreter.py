"""Triton for the kernel tests: under its CPU interpreter (tests/test_triton_*.py), and the sm_90 compile of the
compiled path, which never runs here."""
from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys

import pytest


def import_triton_for_the_interpreter():
    """Triton decides interpreted vs compiled when a function is decorated, its own library (tl.max, tl.sum, ...)
    included, which is decorated by `import triton`: so TRITON_INTERPRET must be set when Triton is first imported
    in this process. It is set for that import only (and again by the fixtures while the kernels are built), so it
    never lingers in the environment of other tests or of their subprocesses."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return pytest.importorskip("triton")    # a guard only: the `test` extra installs triton
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def interpreted_kernels(*modules):
    """Rebuild the kernel modules (oled.kernels.<name>) for the interpreter, in case something imported them
    compiled before; returns a MonkeyPatch holding TRITON_INTERPRET=1, to undo when done. Triton stays in
    interpreter mode for the rest of this process (its library was decorated so)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.max, InterpretedFunction):
        pytest.fail("triton was imported without TRITON_INTERPRET=1 before this module; run it in its own process")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    _patch_device_calls_once(mp)
    for name in modules:
        importlib.reload(importlib.import_module(f"oled.kernels.{name}"))
    return mp


def _patch_device_calls_once(mp: pytest.MonkeyPatch) -> None:
    """The interpreter re-patches triton.language on every call of a device function (a @triton.jit helper, or
    tl.sum, tl.cumsum, ...) from inside a kernel, scanning the language modules each time: 2.4 ms a call, a third
    of an interpreted MoE forward's time. Inside a running kernel those modules are patched already (the kernel's
    launch patched them; a device call's own patches are never undone), so the call runs the function directly
    when every language module it sees is patched, and patches as the interpreter does otherwise."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction, InterpreterError

    is_builtin = tl.core.is_builtin
    interpreted_call = InterpretedFunction.__call__
    langs_of: dict = {}

    def patched(langs) -> bool:
        return not (is_builtin(tl.core.tensor.__add__) or is_builtin(tl.math.exp)
                    or any(is_builtin(lang.load) for lang in langs))

    def call(self, *args, **kwargs):
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = [value for value in self.fn.__globals__.values()
                                         if inspect.ismodule(value) and value in (tl, tl.core)]
        if not langs or not patched(langs):
            return interpreted_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise InterpreterError(repr(e)) from e

    mp.setattr(InterpretedFunction, "__call__", call)
    # and the interpreter's dtype lookup, which builds its table of NumPy dtypes on every call (tens of thousands
    # an interpreted forward): the same answers, from the first call's table
    from triton.runtime import interpreter

    np_dtype = interpreter._get_np_dtype
    by_name: dict = {}

    def cached_np_dtype(tt_dtype):
        # a block's dtype is its element's, a pointer's (or a block of pointers') uint64, as the interpreter has it
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return np_dtype(element)
        found = by_name.get(element.name)
        if found is None:
            found = by_name[element.name] = np_dtype(element)
        return found

    mp.setattr(interpreter, "_get_np_dtype", cached_np_dtype)


def compile_for_sm90(script: str, tmp_path) -> None:
    """Run `script` (which compiles kernels with triton.compile for GPUTarget("cuda", 90, 32) and asserts on their
    PTX) in a process of its own, where Triton is imported compiled, not interpreted; skipped on a Triton wheel
    without its bundled ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas_version

    try:
        get_ptxas_version(90)
    except Exception as e:                                            # a Triton wheel without the CUDA tools
        pytest.skip(f"no usable ptxas: {e}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=root, TRITON_CACHE_DIR=str(tmp_path))       # keep compiled kernels out of ~/.triton
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root, env=env, timeout=300)
