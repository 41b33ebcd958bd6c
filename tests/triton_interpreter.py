"""Run the engine's Triton kernels on the CPU, in Triton's interpreter (tests only).

The interpreter executes kernels with numpy, so CI (no GPU) checks the kernels' logic against
the torch reference; speed and the compiled code are the GPU tests' business. Call
``enable()`` before importing a module that defines kernels: the environment variable is read
when ``@triton.jit`` runs.
"""

from __future__ import annotations

import os


def enable() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "warmgate_patched", False):
        return

    def patched(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        original(tensor, scope)
        # A scalar loaded from a pointer is a one-element array there, and NumPy 2 refuses int() of
        # it: loop bounds read from memory (`range(0, end, BLOCK)`) would fail in the interpreter only.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.warmgate_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
