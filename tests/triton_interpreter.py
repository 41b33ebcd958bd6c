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
    interpreter._convert_float = _rounding_to_fp8_as_sm90(interpreter._convert_float)


def _rounding_to_fp8_as_sm90(convert):  # type: ignore[no-untyped-def]
    """The interpreter's float -> float8 e4m3 conversion (Triton 3.9) rounds ties up rather than to even, does not
    carry a mantissa that rounds up into the exponent (1.98 -> 1.0), and does not saturate. sm_90 rounds to nearest
    even and saturates at 448 (cvt.rn.satfinite): that, through torch, for an fp8 KV cache's writes."""
    import numpy as np
    import torch
    import triton.language as tl

    wide = {tl.float32: np.float32, tl.float16: np.float16}

    def converted(input, input_dtype, output_dtype, rounding_mode):  # type: ignore[no-untyped-def]
        if output_dtype != tl.float8e4nv or input_dtype not in (*wide, tl.bfloat16):
            return convert(input, input_dtype, output_dtype, rounding_mode)
        if input_dtype == tl.bfloat16:  # bf16 is fp32's upper half
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.uint16).astype(np.int32) << 16).view(
                torch.float32)  # fmt: skip
        else:
            values = torch.from_numpy(np.ascontiguousarray(input).view(wide[input_dtype]).astype(np.float32))
        fp8 = torch.float8_e4m3fn
        return values.clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max).to(fp8).view(torch.uint8).numpy()

    return converted


LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "launch_pdl")  # compile options among a launch's keywords
TARGET = ("cuda", 90, 32)  # an H100/H200
POINTER_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8",
                 "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "i1",
                 "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}  # fmt: skip


def record_launches(path: str, execute: bool = True) -> None:
    """From now on, every kernel launch the interpreter runs is written to ``path`` at exit (JSON lines, each once):
    the kernel's module and name, each argument's Triton type (or a constexpr's value), the arguments the JIT would
    specialize as divisible by 16, the compile options (for ``compile_launches`` to compile what a GPU would), and
    the grids it was launched with.
    ``execute=False``: launches are only recorded (their outputs stay as they were: for launch shapes alone)."""
    import atexit
    import inspect
    import json

    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime import interpreter

    seen: dict[str, list[list[int]]] = {}  # a launch -> the grids it was launched with
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        parameters = inspect.signature(self.fn).parameters
        names = list(parameters)
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        launch_only = {k: kwargs.pop(k) for k in list(kwargs) if k not in parameters}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()

        def marked(option: str, name: str) -> bool:  # do_not_specialize lists names or indices
            listed = self.kwargs.get(option) or ()
            return name in listed or names.index(name) in listed

        signature, constants, divisible = {}, {}, []
        for name, value in bound.arguments.items():
            if "constexpr" in str(parameters[name].annotation):  # a Triton dtype as its name: {"tl.dtype": "bf16"}
                constants[name] = {"tl.dtype": str(value)} if isinstance(value, triton.language.dtype) else value
            elif type(value).__name__ == "TensorDescriptor":  # a host-made one: the weight's TMA descriptor
                dtype = POINTER_TYPES[str(value.base.dtype).removeprefix("torch.")]
                signature[name] = f"tensordesc<{dtype}{list(value.block_shape)}>"
            else:  # as the JIT specializes it: the type, and "D" where divisible by 16 (an int 1 becomes a constant)
                kind, key = native_specialize_impl(BaseBackend, value, False, not marked("do_not_specialize", name),
                                                   not marked("do_not_specialize_on_alignment", name))  # fmt: skip
                if kind == "constexpr":
                    constants[name] = key
                    continue
                signature[name] = kind
                if key == "D":
                    divisible.append(name)
        launch = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": signature,
                  "constants": constants, "divisible": divisible, "options": options}  # fmt: skip
        sizes = grid(bound.arguments) if callable(grid) else grid
        seen.setdefault(json.dumps(launch, sort_keys=True), []).append([*sizes, 1, 1][:3])
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs, **options, **launch_only)
        return None

    def write() -> None:
        with open(path, "w") as out:
            out.writelines(json.dumps({**json.loads(line), "grids": grids}) + "\n" for line, grids in seen.items())

    interpreter.InterpretedFunction.run = run
    atexit.register(write)


def compile_launches(path: str) -> list[dict[str, object]]:
    """Compile for an H100/H200 (sm_90, no GPU needed: Triton's compiler and ptxas) every launch ``record_launches``
    wrote, specialized as the JIT would: the interpreter runs a kernel's statements with numpy and lets through code
    the compiler refuses (a variable of one type in an if's then-block and another in its else-block, for one).
    Returns each launch with what the compiled kernel uses (``resources``)."""
    import importlib
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = []
    for line in Path(path).read_text().splitlines():
        launch = json.loads(line)
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        names = list(kernel.arg_names)
        signature = {name: launch["signature"].get(name, "constexpr") for name in names}
        constants = {(names.index(k),): triton.language.dtype(v["tl.dtype"]) if isinstance(v, dict) else v
                     for k, v in launch["constants"].items()}  # fmt: skip
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in launch.get("divisible", ())}
        binary = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget(*TARGET),
                                options=launch["options"])  # fmt: skip
        compiled.append({**launch, **resources(binary)})
    return compiled


SM90 = {"registers": 65536, "shared": 232448, "warps": 64, "blocks": 32}  # per SM (shared: 227 KiB a block at most)


def resources(binary) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """What a compiled kernel uses (registers a thread, bytes of local memory a thread: spills, shared memory a
    block), the programs an SM holds at once with those (from the per-SM limits), and its loads that copy to shared
    memory asynchronously (what the pipeliner made of a loop's loads: none means every tile waits for its load), and
    its L2 prefetches placed before its PDL wait (the PTX's ``prefetch.global.L2`` ahead of ``griddepcontrol.wait``).
    Registers and local memory from cuobjdump (Triton's NVIDIA backend carries it)."""
    import hashlib
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(binary.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    assert found, usage
    registers, stack, static_shared, local = map(int, found.groups())
    shared = binary.metadata.shared + static_shared
    warps = binary.metadata.num_warps
    by_registers = SM90["registers"] // (-(-registers // 8) * 8 * 32 * warps)  # allocated 8 a thread at a time
    per_sm = min(by_registers, SM90["shared"] // shared if shared else SM90["blocks"], SM90["warps"] // warps,
                 SM90["blocks"])  # fmt: skip
    ttgir = binary.asm["ttgir"]
    copies = ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local")
    ptx = binary.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    early_prefetches = ptx.count("prefetch.global.L2", 0, wait) if wait >= 0 else 0
    # The PTX without its line table (.loc/.file and the debug sections): equal across two trees where the code the
    # kernel compiles to is, however its source lines moved.
    code = re.sub(r"^\s*(\.loc|\.file)\b.*$\n?", "", ptx.split(".section\t.debug")[0], flags=re.M)
    return {"registers": registers, "spilled": stack + local, "shared": shared, "programs_per_sm": per_sm,
            "async_copies": copies, "prefetches_before_wait": early_prefetches,
            "ptx_digest": hashlib.sha256(code.encode()).hexdigest()[:12]}  # fmt: skip
