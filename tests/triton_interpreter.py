"""Triton under its CPU interpreter for the kernel tests (tests/test_triton_kernels.py, tests/test_triton_moe.py)."""
from __future__ import annotations

import importlib
import os

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
    for name in modules:
        importlib.reload(importlib.import_module(f"oled.kernels.{name}"))
    return mp
