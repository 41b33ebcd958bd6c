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
    """The model, the cache, the gateway's processes, the active engine's settings, a table of engines and the last
    restarts with their phases."""
    lines = [
        f"model    {status.get('model', MISSING)}",
        f"cache    {_cache_line(status.get('cache', {}))}",
        f"gateway  {_gateway_line(status)}",
        f"engine   {_settings_line(status)}",
        f"memory   {_memory_line(status)}",
        "",
    ]
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
    """The outcome first (ok, or FAILED and why, in one line), then when, why and how, the total; then one line per
    phase with its duration."""
    phases = dict(report.get("phases", {}))
    total = phases.pop("total", None)
    when = time.strftime("%H:%M:%S", time.localtime(report["at"])) if report.get("at") else MISSING
    what = f"{when}  {report.get('reason', MISSING)}  {report.get('strategy', MISSING)}"
    if report.get("ok"):
        how = ", ".join(str(x) for x in (report.get("path"), report.get("weight_source")) if x)
        head = f"ok  {what}  engine {report.get('engine')}" + (f" ({how})" if how else "")
        if total is not None:
            head += f"  total {_seconds(total)}"
        if report.get("drained") is False:  # answered at the switch
            head += "\n    the old engine drains on (warmgate status shows it)"
    else:
        head = f"FAILED  {what}: {report.get('error') or 'no reason given'}"
    if report.get("overrides"):  # engine settings of an admin restart, kept until the next reload
        head += "\n    overrides " + " ".join(f"{k}={v}" for k, v in report["overrides"].items())
    if not phases:
        return head
    rows = [[phase, _seconds(seconds)] for phase, seconds in phases.items()]
    table = tabulate(rows, tablefmt="plain", colalign=("left", "right"), disable_numparse=True)
    return "\n".join([head, *(f"    {line}" for line in table.splitlines())])


def reload_text(report: dict[str, Any]) -> str:
    """The outcome first; what the reload changed; what waits for the next start; the restart it caused (if any)."""
    if report.get("config") is None and "config" in report:
        return ("nothing to re-read: the gateway was started without --config (its environment and command line "
                "are read once, at start)")  # fmt: skip
    lines: list[str] = []
    changed = report.get("changed")
    if not report.get("ok", True):
        lines.append(f"reload FAILED, the engines serve on with the settings they had: {report.get('error')}")
    elif changed is None:
        lines.append("config re-read: no engine or model setting changed, no engine restarted")
    else:
        lines.append("config re-read: " + {
            "model": "the model changed: a new cache process, then the engines swapped",
            "cache": "the cached weights' backend, device or dtype changed: a new cache process, then the engines "
                     "swapped",
        }.get(changed, "engine settings changed: the engines rolled over on the cached weights"))  # fmt: skip
    if report.get("applied"):
        lines.append("applied now: " + ", ".join(report["applied"]))
    if report.get("pending"):
        lines.append("at the next start (a running gateway keeps them): " + ", ".join(report["pending"]))
    if changed is not None:
        lines.append(restart_text(report))
    return "\n".join(lines)


def _settings_line(status: dict[str, Any]) -> str:
    """The active engine's settings (what it runs with, overrides included)."""
    active = next((e for e in status.get("engines", []) if e.get("id") == status.get("active")), None)
    if active is None:
        return "no active engine"
    return " ".join(f"{k}={v}" for k, v in (active.get("settings") or {}).items()) or MISSING


def _memory_line(status: dict[str, Any]) -> str:
    """The active engine's memory plan (engine/memory_plan.py): its sequences and KV cache, and on a GPU the
    share of the device it was planned from."""
    active = next((e for e in status.get("engines", []) if e.get("id") == status.get("active")), None)
    plan = (active or {}).get("memory")
    if not plan:
        return MISSING
    line = (f"max_num_seqs={plan.get('max_num_seqs')} max_model_len={plan.get('max_model_len')} "
            f"kv cache {_bytes(plan.get('kv_cache_bytes'))} ({plan.get('kv_tokens', MISSING)} tokens)")  # fmt: skip
    device = plan.get("device")
    if device:
        line += (f"; {device['gpu_memory_fraction']} of the device's {_bytes(device['device_bytes'])}: weights "
                 f"{_bytes(device['weights_bytes'])}{'' if device['shared_weights'] else ' each'}, "
                 f"{device.get('engines', device['kv_share'])} engines of {_bytes(device['engine_reserve_bytes'])}, "
                 f"{device['kv_share']} KV caches")  # fmt: skip
    return line


def _gateway_line(status: dict[str, Any]) -> str:
    """The supervisor's pid and the relays' (a relay not connected to the supervisor is marked)."""
    relays = status.get("relays", [])
    pids = ", ".join(f"{r.get('pid')}" + ("" if r.get("connected", True) else " (not connected)") for r in relays)
    supervisor = status.get("supervisor") or {}
    serve = f"serve pid {supervisor['serve_pid']}  " if "serve_pid" in supervisor else ""
    return f"{serve}supervisor pid {supervisor.get('pid', MISSING)}  {len(relays)} relays" + \
        (f" (pids {pids})" if relays else "")  # fmt: skip


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
