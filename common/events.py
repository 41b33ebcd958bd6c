"""Structured logs for warmgate's processes: one event per line, key=value pairs."""

from __future__ import annotations

import logging
from typing import Any


def log_event(logger: logging.Logger, event: str, **fields: Any) -> None:
    """One structured log line: event=... key=value ..."""
    _emit(logger, logging.INFO, event, fields)


def log_warning(logger: logging.Logger, event: str, **fields: Any) -> None:
    """A structured line for something that went wrong and was handled (a crash, a failed restart)."""
    _emit(logger, logging.WARNING, event, fields)


def log_error(logger: logging.Logger, event: str, **fields: Any) -> None:
    """A structured line for something that went wrong and is not handled yet (a cache that does not restart)."""
    _emit(logger, logging.ERROR, event, fields)


def _emit(logger: logging.Logger, level: int, event: str, fields: dict[str, Any]) -> None:
    parts = [f"event={event}"]
    for key, value in fields.items():
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        parts.append(f"{key}={text}" if " " not in text else f'{key}="{text}"')
    logger.log(level, " ".join(parts))


def configure_logging() -> None:
    """Log to stderr at INFO, unless somebody (a test, an embedding program) configured logging already."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
            datefmt="%Y-%m-%dT%H:%M:%S",
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is noise
