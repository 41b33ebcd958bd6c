"""JSON as the hot paths write and read it (the framed messages of common/framing.py, the relays' request bodies):
pydantic_core's encoder and decoder, json's for what they refuse.

On this machine's CPU a 2,053-token prompt's ids take 33 µs to write and 59 to read this way, against 133 and 119
with json. The values are json's: NaN and Infinity both ways, integers of any size. What pydantic_core refuses and
json does not: writing a string with a lone surrogate (a path that is not UTF-8, as os.fsdecode gives it: json
escapes it), and reading that escape or nesting deeper than its limit.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON."""
    try:
        return pydantic_core.to_json(value)
    except pydantic_core.PydanticSerializationError:
        return json.dumps(value, separators=(",", ":")).encode()


def loads(body: bytes | bytearray) -> Any:
    """The value of a JSON document; ValueError (or RecursionError) for one that is not valid JSON."""
    try:
        return pydantic_core.from_json(body)
    except ValueError:
        return json.loads(body)
