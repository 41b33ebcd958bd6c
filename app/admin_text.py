"""The admin documents (/admin/status, restart and reload reports) as short text for operators.

`warmgate status | restart | reload` print these; `--json` prints the documents themselves. Fields
a document lacks (a cache that did not answer, an engine still starting) show as "-".
"""

from __future__ import annotations

import time
from typing import Any

from tabulate import tabulate

RESTARTS_SHOWN = 5  # the status page keeps 20; the last few say what an operator needs
MISSING = "-"


def status_text(status: dict[str, Any]) -> str:
    """The model, the cache, the gateway's processes, a table of engines and the last restarts with their phases."""
    lines = [f"model    {status.get('model', MISSING)}", f"cache    {_cache_line(status.get('cache', {}))}",
             f"gateway  {_gateway_line(status)}", ""]
    engines = status.get("engines", [])
    if engines:
        rows = [[e.get("id"), e.get("state"), e.get("pid"), e.get("weight_source") or MISSING,
                 _duration(e.get("uptime_s")), _bytes(e.get("private_memory_bytes")),
                 _bytes(e.get("device_memory_bytes"))] for e in engines]  # fmt: skip
        headers = ["engine", "state", "pid", "weights", "uptime", "private mem", "device mem"]
        lines.append(tabulate(rows, headers, tablefmt="simple", disable_numparse=True))
    else:
        lines.append("no engines")
    restarts = status.get("restarts", [])
    if restarts:
        lines += ["", f"last restarts ({min(len(restarts), RESTARTS_SHOWN)} of {len(restarts)}, newest last)"]
        for report in restarts[-RESTARTS_SHOWN:]:
            lines.append(restart_text(report))
    return "\n".join(lines)


def restart_text(report: dict[str, Any]) -> str:
    """One line for the restart (when, why, how, outcome, total), then one line per phase with its duration."""
    phases = dict(report.get("phases", {}))
    total = phases.pop("total", None)
    when = time.strftime("%H:%M:%S", time.localtime(report["at"])) if report.get("at") else MISSING
    if report.get("ok"):
        how = ", ".join(str(x) for x in (report.get("path"), report.get("weight_source")) if x)
        outcome = f"ok: engine {report.get('engine')}" + (f" ({how})" if how else "")
    else:
        outcome = f"FAILED: {report.get('error') or 'no reason given'}"
    head = f"{when}  {report.get('reason', MISSING)}  {report.get('strategy', MISSING)}  {outcome}"
    if total is not None:
        head += f"  total {_seconds(total)}"
    if not phases:
        return head
    rows = [[phase, _seconds(seconds)] for phase, seconds in phases.items()]
    table = tabulate(rows, tablefmt="plain", colalign=("left", "right"), disable_numparse=True)
    return "\n".join([head, *(f"    {line}" for line in table.splitlines())])


def reload_text(report: dict[str, Any]) -> str:
    """What the reload changed, and the restart it caused (if any)."""
    changed = report.get("changed")
    if changed is None:
        return "config re-read: no engine or model setting changed, nothing restarted"
    what = {
        "model": "the model changed: a new cache process, then the engines swapped",
        "cache": "the cached weights' backend, device or dtype changed: a new cache process, then the engines swapped",
    }.get(changed, "engine settings changed: the engines rolled over on the cached weights")
    return f"config re-read: {what}\n{restart_text(report)}"


def _gateway_line(status: dict[str, Any]) -> str:
    """The supervisor's pid and the relays' (a relay not connected to the supervisor is marked)."""
    relays = status.get("relays", [])
    pids = ", ".join(f"{r.get('pid')}" + ("" if r.get("connected", True) else " (not connected)") for r in relays)
    supervisor = (status.get("supervisor") or {}).get("pid", MISSING)
    return f"supervisor pid {supervisor}  {len(relays)} relays" + (f" (pids {pids})" if relays else "")


def _cache_line(cache: dict[str, Any]) -> str:
    if "error" in cache:
        return f"not answering ({cache['error']}) on {cache.get('socket', MISSING)}"
    leases = cache.get("leases", [])
    count = len(leases) if isinstance(leases, list) else leases
    parts = [cache.get("device", MISSING), _bytes(cache.get("bytes")), f"{count} leases",
             f"{cache.get('attach_count', MISSING)} attaches", f"up {_duration(cache.get('uptime_s'))}",
             f"pid {cache.get('pid', MISSING)}", f"key {str(cache.get('key', MISSING))[:12]}"]  # fmt: skip
    return "  ".join(str(p) for p in parts)


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _duration(value: float | None) -> str:
    if value is None:
        return MISSING
    seconds = int(value)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= size:
            return f"{seconds // size}{unit}{(seconds % size) // sub_size:02d}{sub}"
    return f"{seconds}s"


def _bytes(value: int | None) -> str:
    if value is None:
        return MISSING
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
