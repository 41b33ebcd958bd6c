"""Tensor-level validation: every expected tensor present, with the dtype and shape its scheme needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cache.checkpoint.architecture import ModelLayout
from cache.checkpoint.schemes import Activations, LinearScheme, WeightKind
from cache.checkpoint.tensor_index import TensorInfo
from cache.errors import InvalidTensor, MissingTensor, UnexpectedTensor

if TYPE_CHECKING:
    from cache.checkpoint.reader import Checkpoint

FLOAT_DTYPES = ("BF16", "F16", "F32")
SCALAR_SHAPES = ((), (1,))


@dataclass(frozen=True)
class TensorSpec:
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # any of these


def expected_tensors(layout: ModelLayout, schemes: dict[str, LinearScheme]) -> dict[str, TensorSpec]:
    """The tensors a checkpoint with this layout and these schemes must hold."""
    spec = {name: TensorSpec(FLOAT_DTYPES, (shape,)) for name, shape in layout.others.items()}
    for module, (n, k) in layout.linears.items():
        scheme = schemes[module]
        if not scheme.quantized:
            spec[f"{module}.weight"] = TensorSpec(FLOAT_DTYPES, ((n, k),))
            continue
        spec[f"{module}.weight"] = TensorSpec(("F8_E4M3",), ((n, k),))
        scale_shape = scheme.scale_shape(n, k)
        shapes = SCALAR_SHAPES if scheme.weight is WeightKind.FP8_TENSOR else (scale_shape,)
        spec[f"{module}.weight_scale"] = TensorSpec(FLOAT_DTYPES, shapes)
        if scheme.activations is Activations.STATIC_TENSOR:
            spec[f"{module}.input_scale"] = TensorSpec(FLOAT_DTYPES, SCALAR_SHAPES)
    return spec


def check_tensors(layout: ModelLayout, schemes: dict[str, LinearScheme], tensors: dict[str, TensorInfo]) -> None:
    """Raise on the first missing, unexpected, mistyped or misshapen tensor."""
    spec = expected_tensors(layout, schemes)
    for name in spec:
        if name not in tensors and name not in layout.optional:
            module, field = _split(name)
            missing = sorted(set(spec) - set(tensors) - layout.optional)
            more = f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""
            raise MissingTensor(
                f"tensor {field!r} ({_describe(spec[name])}) is missing{more}", layer=module, field=field
            )
    for name in tensors:
        if name not in spec and not layout.ignored(name):
            module, field = _split(name)
            scheme = schemes.get(module)
            hint = f" (layer scheme: {scheme.describe()})" if scheme else ""
            raise UnexpectedTensor(f"tensor {field!r} is not expected{hint}", layer=module, field=field)
    for name, want in spec.items():  # model order: the first bad tensor reported is the shallowest
        info = tensors.get(name)
        if info is None:
            continue
        module, field = _split(name)
        if info.dtype not in want.dtypes:
            raise InvalidTensor(
                f"{field}.dtype={info.dtype} is not supported", layer=module, field=f"{field}.dtype",
                value=info.dtype, supported=want.dtypes,
            )  # fmt: skip
        if info.shape not in want.shapes:
            expected = " or ".join(str(list(s)) for s in want.shapes)
            raise InvalidTensor(
                f"{field}.shape={list(info.shape)} does not match config.json and the scheme (expected {expected})",
                layer=module, field=f"{field}.shape", value=list(info.shape),
            )  # fmt: skip


def check_scales(ckpt: Checkpoint) -> None:
    """Every weight_scale / input_scale finite and > 0 (reads only the small scale tensors)."""
    for name in ckpt.tensors:
        module, field = _split(name)
        if field not in ("weight_scale", "input_scale"):
            continue
        scale = ckpt.tensor(name).float()
        bad = ~(scale.isfinite() & (scale > 0))
        if bool(bad.any()):
            first = scale[bad].flatten()[0].item()
            raise InvalidTensor(
                f"{field} has {int(bad.sum())} non-finite or non-positive values (e.g. {first})",
                layer=module, field=field, value=first, supported="finite values > 0",
            )  # fmt: skip


def _split(name: str) -> tuple[str, str]:
    module, _, field = name.rpartition(".")
    return module, field


def _describe(spec: TensorSpec) -> str:
    return f"{'/'.join(spec.dtypes)} {' or '.join(str(list(s)) for s in spec.shapes)}"
