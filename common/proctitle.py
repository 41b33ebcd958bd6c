"""Process titles: `ps` says what each warmgate process is (`warmgate: engine 1-3 standby /tmp/warmgate`), not
`python -m app.cli fork-server` for every forked engine."""

from __future__ import annotations

import setproctitle


def set_title(title: str) -> None:
    setproctitle.setproctitle(f"warmgate: {title}")
