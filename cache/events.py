"""Structured logs for warmgate's processes: one event per line, key=value pairs."""

from __future__ import annotations

import logging
from typing import Any


def log_event(logger: logging.Logger, event: str, **fields: Any) -> None:
    """One structured log line: event=... key=value ..."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        parts.append(f"{key}={text}" if " " not in text else f'{key}="{text}"')
    logger.info(" ".join(parts))


def configure_logging() -> None:
    """Log to stderr at INFO, unless somebody (a test, an embedding program) configured logging already."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
            datefmt="%Y-%m-%dT%H:%M:%S",
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is noise
