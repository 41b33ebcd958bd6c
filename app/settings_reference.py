"""The settings reference: every setting of the gateway's config file, rendered from the models themselves
(app/config.py's Settings, GatewaySettings, RestartSettings; common/settings.py's EngineSettings), so the
documentation cannot say other than the code.

    python -m app.settings_reference                  # print the reference (markdown)
    python -m app.settings_reference --write README.md  # replace the block between the markers in README.md

README.md holds the rendered text between ``<!-- settings: begin -->`` and ``<!-- settings: end -->``;
tests/test_docs.py checks that it equals a fresh rendering.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from app.config import Settings

BEGIN = "<!-- settings: begin -->"
END = "<!-- settings: end -->"
TOP_LEVEL = "top level"


def sections(model: type[BaseModel] = Settings) -> list[tuple[str, type[BaseModel], dict[str, FieldInfo]]]:
    """(title, model, its scalar fields): the top level first, then one per nested section, in field order."""
    top = {name: f for name, f in model.model_fields.items() if not _is_section(f)}
    out: list[tuple[str, type[BaseModel], dict[str, FieldInfo]]] = [(TOP_LEVEL, model, top)]
    for name, field in model.model_fields.items():
        if _is_section(field):
            section: type[BaseModel] = field.annotation  # type: ignore[assignment]
            out.append((f"[{name}]", section, dict(section.model_fields)))
    return out


def render(model: type[BaseModel] = Settings) -> str:
    """Markdown: per section, a heading and a table of setting, type, default and description."""
    lines: list[str] = []
    for title, _, fields in sections(model):
        prefix = "WARMGATE_" if title == TOP_LEVEL else f"WARMGATE_{title.strip('[]').upper()}__"
        example = f"{prefix}{next(iter(fields)).upper()}"
        lines += [f"**`{title}`**" if title != TOP_LEVEL else "**top level** (before any section)", "",
                  f"Environment: `{example}` and so on (`{prefix}` and the setting's name in capitals).", "",
                  "| setting | type | default | what it is |", "|---|---|---|---|"]  # fmt: skip
        for name, field in fields.items():
            if not field.description:
                raise ValueError(f"{title} {name} has no description (Field(description=...))")
            default = f"`{_default(field.default)}`" + _size(field.default)
            row = [f"`{name}`", _cell(_type(field)), default, _cell(field.description)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _is_section(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


def _type(field: FieldInfo) -> str:
    text = _annotation(field.annotation)
    bounds = []
    for meta in field.metadata:  # the constraints of Field(ge=..., ...)
        if isinstance(meta, annotated_types.Ge):
            bounds.append(f">= {meta.ge}")
        elif isinstance(meta, annotated_types.Gt):
            bounds.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Le):
            bounds.append(f"<= {meta.le}")
        elif isinstance(meta, annotated_types.Lt):
            bounds.append(f"< {meta.lt}")
    return f"{text}, {', '.join(bounds)}" if bounds else text


def _annotation(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " or ".join(f'"{a}"' for a in get_args(annotation))
    if origin is Union or origin is types.UnionType:
        return " or ".join(_annotation(a) for a in get_args(annotation))
    if origin is list:
        return f"list of {_annotation(get_args(annotation)[0])}"
    if annotation is type(None):
        return "none"
    if annotation is Path:
        return "path"
    return str(getattr(annotation, "__name__", annotation))


def _default(value: Any) -> str:
    """As it would be written in the TOML file; ``none``: not set (TOML has no null: leave the key out)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_default(v) for v in value) + "]"
    return str(value)


def _size(value: Any) -> str:
    """A whole number of MiB or GiB, said so (8388608 is 8 MiB)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**20:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
            if value % size == 0:
                return f" ({value // size} {unit})"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def replace_block(document: str, block: str) -> str:
    """``document`` with the text between the markers replaced by ``block``."""
    head, begin, rest = document.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the markers {BEGIN} and {END} are not both there")
    return f"{head}{BEGIN}\n{block}{END}{tail}"


def block_in(document: str) -> str:
    """The text between the markers (what replace_block put there)."""
    _, begin, rest = document.partition(BEGIN)
    inside, end, _ = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the markers {BEGIN} and {END} are not both there")
    return inside.removeprefix("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.settings_reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, metavar="FILE", help="replace the block between the markers in FILE")
    args = parser.parse_args(argv)
    text = render()
    if args.write is None:
        sys.stdout.write(text)
    else:
        args.write.write_text(replace_block(args.write.read_text(), text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
