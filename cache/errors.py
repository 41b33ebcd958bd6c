"""Typed errors for checkpoints warmgate cannot serve.

Each error carries where (file, layer), what (field, value) and the fix (what is
supported); ``str(err)`` is the one line shown to users on the CLI and over HTTP.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """A checkpoint that cannot be served; the message names the place and the fix."""

    kind = "checkpoint error"

    def __init__(
        self,
        detail: str,
        *,
        path: str | None = None,
        layer: str | None = None,
        field: str | None = None,
        value: Any = None,
        supported: Any = None,
    ) -> None:
        self.detail = detail
        self.path = path
        self.layer = layer
        self.field = field
        self.value = value
        self.supported = supported
        super().__init__(self.render())

    def render(self) -> str:
        where = self.layer or self.path or "checkpoint"
        line = f"{where}: {self.detail}"
        if self.supported is not None:
            supported = self.supported if isinstance(self.supported, str) else _fmt(self.supported)
            line += f" (supported: {supported})"
        return line


class UnsupportedArchitecture(CheckpointError):
    kind = "unsupported architecture"


class UnsupportedQuantization(CheckpointError):
    """A quantization field whose value warmgate does not serve (never silently converted)."""

    kind = "unsupported quantization"

    def __init__(self, *, layer: str, field: str, value: Any, supported: Any, path: str | None = None):
        super().__init__(
            f"{field}={_fmt(value)} is not supported",
            path=path,
            layer=layer,
            field=field,
            value=value,
            supported=supported,
        )


class InvalidTensor(CheckpointError):
    """A tensor whose dtype, shape or values do not match its layer's scheme."""

    kind = "invalid tensor"


class MissingTensor(CheckpointError):
    kind = "missing tensor"


class UnexpectedTensor(CheckpointError):
    kind = "unexpected tensor"


class CorruptCheckpoint(CheckpointError):
    """Unreadable files: bad JSON, a truncated or malformed safetensors file."""

    kind = "corrupt checkpoint"


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return ", ".join(sorted(value)) if isinstance(value, (set, frozenset)) else ", ".join(value)
    return str(value)
