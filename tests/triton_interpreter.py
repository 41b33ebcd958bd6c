"""Run the engine's Triton kernels on the CPU, in Triton's interpreter (tests only).

The interpreter executes kernels with numpy, so CI (no GPU) checks the kernels' logic against
the torch reference; speed and the compiled code's results are the GPU tests' business. Call
``enable()`` before importing a module that defines kernels: the environment variable is read
when ``@triton.jit`` runs. ``record_launches`` notes every launch the interpreter runs, and
``compile_launches`` compiles them for sm_90 in another process (Triton's compiler needs no GPU):
the interpreter runs code the compiler refuses.
"""

from __future__ import annotations

import os
from pathlib import Path


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


LAUNCH_OPTIONS = ("num_warps", "num_stages")  # compile options among a launch's keywords; others only launch
POINTER_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8",
                 "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}  # fmt: skip


def record_launches(path: str) -> None:
    """From now on, every kernel launch the interpreter runs is written to ``path`` at exit (JSON lines, each once):
    the kernel's module and name, each argument's Triton type (or a constexpr's value) and the compile options, for
    ``compile_launches`` to compile for a GPU."""
    import atexit
    import inspect
    import json

    from triton.runtime import interpreter

    seen: dict[str, None] = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        parameters = inspect.signature(self.fn).parameters
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        launch_only = {k: kwargs.pop(k) for k in list(kwargs) if k not in parameters}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constants = {}, {}
        for name, value in bound.arguments.items():
            if "constexpr" in str(parameters[name].annotation):
                constants[name] = value
            elif type(value).__name__ == "TensorDescriptor":  # a host-made one: the weight's TMA descriptor
                dtype = POINTER_TYPES[str(value.base.dtype).removeprefix("torch.")]
                signature[name] = f"tensordesc<{dtype}{list(value.block_shape)}>"
            elif hasattr(value, "dtype"):
                signature[name] = "*" + POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                signature[name] = "fp32"
        launch = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                  "constants": constants, "options": options}  # fmt: skip
        seen[json.dumps(launch, sort_keys=True)] = None
        return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options, **launch_only)

    def write() -> None:
        with open(path, "w") as out:
            out.writelines(line + "\n" for line in seen)

    interpreter.InterpretedFunction.run = run
    atexit.register(write)


def compile_launches(path: str) -> int:
    """Compile for an H100/H200 (sm_90, no GPU needed: Triton's compiler and ptxas) every launch ``record_launches``
    wrote: the interpreter runs a kernel's statements with numpy and lets through code the compiler refuses (a
    variable of one type in an if's then-block and another in its else-block, for one). Returns how many."""
    import importlib
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    count = 0
    for line in Path(path).read_text().splitlines():
        launch = json.loads(line)
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        names = list(kernel.arg_names)
        signature = {name: launch["signature"].get(name, "constexpr") for name in names}
        constants = {(names.index(k),): v for k, v in launch["constants"].items()}
        triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                       options=launch["options"])  # fmt: skip
        count += 1
    return count
