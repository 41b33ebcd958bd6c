"""warmgate: an OpenAI-compatible LLM gateway whose engines restart on weights kept in memory.

The `warmgate` command line. Heavy imports (torch, transformers) happen inside subcommands."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

SCHEMES = ("bf16", "fp8-block", "fp8-channel", "fp8-tensor")
FP8_SCHEMES = SCHEMES[1:]
SHAPES = ("smollm2-135m", "qwen3-0.6b", "llama3-8b", "llama3-70b")


class RestartFailed(RuntimeError):
    """The gateway reported a restart (or a reload) that failed; its report has been printed."""


def build_parser() -> argparse.ArgumentParser:
    from app.config import GatewaySettings, Settings

    default_run_dir = Settings.model_fields["run_dir"].default
    gateway = GatewaySettings()
    parser = argparse.ArgumentParser(prog="warmgate", description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="make, quantize and check checkpoints")
    model_cmds = model.add_subparsers(dest="model_command", required=True)

    demo = model_cmds.add_parser("demo", help="build the SmolLM2-135M-Instruct demo checkpoint (offline)")
    demo.add_argument("--out", type=Path, help="output directory (default: the warmgate cache dir)")
    demo.add_argument("--scheme", choices=SCHEMES, default="bf16",
                      help="bf16, or FP8 W8A8 made from it (default: bf16)")  # fmt: skip
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)

    quant = model_cmds.add_parser("quantize", help="write a compressed-tensors FP8 W8A8 checkpoint")
    quant.add_argument("src", type=Path, help="a bf16/fp16/fp32 Hugging Face checkpoint directory")
    quant.add_argument("out", type=Path, help="the directory to write")
    quant.add_argument("--scheme", choices=FP8_SCHEMES, required=True, help="128x128 blocks, per channel or per tensor")
    quant.add_argument("--force", action="store_true", help="replace OUT if it exists")
    quant.add_argument("--quiet", action="store_true", help="no progress bars")
    quant.set_defaults(run=_quantize)

    synth = model_cmds.add_parser("synth", help="random weights of a real model shape (benchmarks only)")
    synth.add_argument("out", type=Path, help="the directory to write")
    synth.add_argument("--shape", choices=SHAPES, required=True, help="the model whose shapes to copy")
    synth.add_argument("--scheme", choices=SCHEMES, default="fp8-block", help="default: fp8-block")
    synth.add_argument("--layers", type=int, help="fewer layers than the real model (same widths)")
    synth.add_argument("--device", default="cpu", help="where to generate and quantize (cpu, cuda)")
    synth.add_argument("--tokenizer", type=Path, help="tokenizer files to copy (default: the demo's, if built)")
    synth.add_argument("--seed", type=int, default=0, help="of the random weights (default: 0)")
    synth.add_argument("--force", action="store_true", help="replace OUT if it exists")
    synth.add_argument("--quiet", action="store_true", help="no progress bars")
    synth.set_defaults(run=_synth)

    check = model_cmds.add_parser("check", help="validate a checkpoint and print its per-layer schemes")
    check.add_argument("path", type=Path, help="a Hugging Face checkpoint directory")
    check.set_defaults(run=_check)

    cache = commands.add_parser("cache", help="run the cache process: a model's processed weights, shared with engines")
    cache.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    cache.add_argument("--socket", type=Path, required=True, help="Unix socket to serve on (its directory: 0700)")
    cache.add_argument("--device", default="auto", help="where the weights are kept: auto (cuda if torch sees a GPU, "
                       "else cpu), cpu, cuda or cuda:N")  # fmt: skip
    cache.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="the engines' compute dtype (auto: the backend's default for the device)")  # fmt: skip
    cache.add_argument("--backend", default="native", choices=("native", "vllm"),
                       help="whose weight processor lays the tensors out (the engines' backend)")  # fmt: skip
    cache.set_defaults(run=_cache)

    serve = commands.add_parser("serve", help="run the OpenAI gateway: cache process, engines, HTTP API")
    serve.add_argument("--model", type=Path, help="checkpoint directory (default: the demo, built if needed)")
    serve.add_argument("--host", help=f"address to listen on (default: {gateway.host})")
    serve.add_argument("--port", type=int, help=f"port (default: {gateway.port}; 0: any free port, recorded in "
                       "RUN_DIR/address)")  # fmt: skip
    serve.add_argument("--config", type=Path, help="TOML config file (WARMGATE_* environment variables override it)")
    serve.add_argument("--run-dir", type=Path, help=f"sockets, logs, the admin token and the address, mode 0700; one "
                       f"gateway at a time (default: {default_run_dir})")  # fmt: skip
    serve.set_defaults(run=_serve)

    # The control plane, started (and restarted) by `warmgate serve`: not a command for people.
    supervisor = commands.add_parser("supervisor", parents=[serve], add_help=False, conflict_handler="resolve")
    supervisor.add_argument("--listen-fd", type=int, required=True, help="the listening socket, from warmgate serve")
    supervisor.add_argument("--ready-fd", type=int, required=True, help="written to once the gateway serves")
    supervisor.add_argument("--upgrade", action="store_true", help="replace the relays it adopts with new ones")
    supervisor.set_defaults(run=_supervisor)

    for name, help_text in (("status", "show a running gateway's engines, cache and restarts"),
                            ("restart", "restart the engines of a running gateway (on the cached weights)"),
                            ("reload", "make a running gateway re-read its config file")):  # fmt: skip
        admin = commands.add_parser(name, help=help_text)
        admin.add_argument("--run-dir", type=Path, help=f"the gateway's run dir: its address and admin token are "
                           f"read there (default: {default_run_dir}, or WARMGATE_RUN_DIR)")  # fmt: skip
        admin.add_argument("--url", help="the gateway's address (default: the one recorded in the run dir)")
        admin.add_argument("--json", action="store_true", help="print the JSON document instead of a summary")
        if name == "restart":
            admin.add_argument("--strategy", choices=("overlap", "replace"),
                               help="overlap: the new engine first, then drain the old; replace: drain first "
                               "(default: the config's restart.strategy)")  # fmt: skip
            admin.add_argument("--wait", choices=("switch", "drained"), default="switch",
                               help="answer once the new engine takes traffic (switch, the default; the old one "
                               "drains on, as `warmgate status` shows) or once the old one has drained")  # fmt: skip
        admin.set_defaults(run=_admin, admin_command=name)

    for name, help_text in (("stop", "stop a gateway and every process it runs (also one whose `warmgate serve` "
                             "is gone)"),
                            ("upgrade", "replace a running gateway's own processes with the installed code, without "
                             "refusing a connection or failing a request (engines and cache serve on)")):  # fmt: skip
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--run-dir", type=Path, help=f"the gateway's run dir (default: {default_run_dir}, or "
                             "WARMGATE_RUN_DIR)")  # fmt: skip
        command.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for it (default: 300)")
        command.set_defaults(run=_stop if name == "stop" else _upgrade)

    engine = commands.add_parser("engine", help="run an engine worker serving the OpenAI API on a Unix socket")
    engine.add_argument("--socket", type=Path, required=True, help="Unix socket path to serve on (mode 0600)")
    engine.add_argument("--config", required=True, help="engine config: a .json/.toml file or an inline JSON object")
    engine.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests before exiting"
    )
    engine.add_argument("--heartbeat", type=Path, help="a heartbeat file (made by the supervisor) to stamp while "
                        "the engine makes progress: its liveness signal")  # fmt: skip
    engine.add_argument("--lifeline", type=Path, help="a lifeline file (made by the supervisor) whose lock the "
                        "engine holds for its life: its death is seen there at once (common/lifeline.py)")  # fmt: skip
    engine.set_defaults(run=_engine)

    relay = commands.add_parser("relay")  # started by `warmgate serve`, one per worker
    relay.add_argument("--control", type=Path, required=True, help="the supervisor's control socket")
    relay.add_argument("--listen-fd", type=int, required=True, help="the inherited listening socket's descriptor")
    relay.add_argument("--index", type=int, required=True, help="this relay's number (0 .. workers-1)")
    relay.add_argument("--board", type=Path, required=True, help="the admission board the relays share")
    relay.add_argument("--drain-timeout", type=float, default=30.0, help="seconds requests get to finish on SIGTERM")
    relay.set_defaults(run=_relay)

    # Started by `warmgate serve` (engine/fork_server.py): not a command for people, so not in the help.
    forks = commands.add_parser("fork-server")
    forks.add_argument("--socket", type=Path, required=True, help="Unix socket to take spawn requests on")
    forks.add_argument("--backend", default="native", choices=("native", "vllm"),
                       help="also import this engine backend's modules before forking")  # fmt: skip
    forks.set_defaults(run=_fork_server)
    # The commands people run (relay, fork-server and supervisor are started by `warmgate serve` and hidden: added
    # with no help, argparse lists no line for them; help=SUPPRESS printed "==SUPPRESS==" lines on Python 3.11).
    hidden = ("relay", "fork-server", "supervisor")
    commands.metavar = "{" + ",".join(c for c in commands.choices if c not in hidden) + "}"
    return parser


def _demo(args: argparse.Namespace) -> None:
    from cache.checkpoint.demo import build_demo

    start = time.monotonic()
    path = build_demo(args.scheme, args.out, progress=not args.quiet)
    _print_check(path)
    print(f"demo checkpoint ready in {time.monotonic() - start:.1f}s: {path}")


def _quantize(args: argparse.Namespace) -> None:
    from cache.checkpoint.quantize import quantize_checkpoint

    path = quantize_checkpoint(args.src, args.out, args.scheme, force=args.force, progress=not args.quiet)
    _print_check(path)


def _synth(args: argparse.Namespace) -> None:
    from cache.checkpoint.demo import demo_dir
    from cache.checkpoint.synth import synth_checkpoint

    tokenizer = args.tokenizer
    if tokenizer is None and (demo_dir("bf16") / "tokenizer.json").is_file():
        tokenizer = demo_dir("bf16")
    if tokenizer is None:
        print("note: no tokenizer copied (build the demo first or pass --tokenizer)", file=sys.stderr)
    path = synth_checkpoint(args.out, args.shape, args.scheme, num_layers=args.layers, device=args.device,
                            tokenizer=tokenizer, seed=args.seed, force=args.force,
                            progress=not args.quiet)  # fmt: skip
    _print_check(path)


def _check(args: argparse.Namespace) -> None:
    _print_check(args.path)


def _serve_options(args: argparse.Namespace) -> dict[str, object]:
    return {"model": args.model, "run_dir": args.run_dir, "gateway.host": args.host, "gateway.port": args.port}


def _serve(args: argparse.Namespace) -> None:
    from app.supervisor.master import SupervisorExited
    from app.supervisor.master import main as run_gateway

    passed = [("--config", args.config), ("--model", args.model), ("--run-dir", args.run_dir), ("--host", args.host),
              ("--port", args.port)]  # fmt: skip
    argv = [str(part) for flag, value in passed if value is not None for part in (flag, value)]
    try:
        code = run_gateway(argv, args.config, **_serve_options(args))
    except SupervisorExited as exc:  # it printed why, as one line
        raise SystemExit(exc.code) from None
    if code:
        raise SystemExit(code)


def _supervisor(args: argparse.Namespace) -> None:
    from app.supervisor.serve import main as run_supervisor

    run_supervisor(args.config, args.listen_fd, args.ready_fd, args.upgrade, **_serve_options(args))


def _stop(args: argparse.Namespace) -> None:
    from app.supervisor.lifecycle import stop_gateway

    print(stop_gateway(_run_dir(args), args.timeout))


def _upgrade(args: argparse.Namespace) -> None:
    from app.supervisor.lifecycle import upgrade_gateway

    print(upgrade_gateway(_run_dir(args), args.timeout))


def _run_dir(args: argparse.Namespace) -> Path:
    from app.config import load_settings

    return args.run_dir.expanduser().resolve() if args.run_dir else load_settings(None).run_dir


def _admin(args: argparse.Namespace) -> None:
    import json
    import os

    import httpx

    from app.admin_text import reload_text, restart_text, status_text
    from app.config import load_settings
    from app.supervisor.run_dir import read_address
    from app.supervisor.serve import TOKEN_FILE

    run_dir = args.run_dir or load_settings(None).run_dir
    url = (args.url or read_address(run_dir).url).rstrip("/")
    token = os.environ.get("WARMGATE_ADMIN_TOKEN")
    if not token:
        path = run_dir / TOKEN_FILE
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"no admin token in {path} ({exc.strerror}): pass the gateway's --run-dir, or set "
                             "WARMGATE_ADMIN_TOKEN") from None  # fmt: skip
    headers = {"authorization": f"Bearer {token}"}
    try:
        if args.admin_command == "status":
            response = httpx.get(f"{url}/admin/status", headers=headers, timeout=30)
        else:
            body = {"strategy": args.strategy} if getattr(args, "strategy", None) else {}
            if getattr(args, "wait", "switch") != "switch":
                body["wait"] = args.wait
            response = httpx.post(f"{url}/admin/{args.admin_command}", json=body, headers=headers, timeout=None)
    except httpx.TransportError as exc:
        raise ConnectionError(f"no gateway at {url}: {exc}") from None
    try:
        document = response.json()
    except ValueError:
        raise ValueError(f"{url} answered {response.status_code} without JSON: {response.text[:200]}") from None
    if isinstance(document.get("error"), dict):  # an OpenAI-shaped refusal (bad token, invalid config, ...)
        raise ValueError(f"{response.status_code}: {document['error'].get('message', response.text)}")
    text = {"status": status_text, "restart": restart_text, "reload": reload_text}[args.admin_command]
    print(json.dumps(document, indent=2) if args.json else text(document))
    if not document.get("ok", True):  # a report of a restart that failed: printed above, and the exit status says so
        raise RestartFailed(f"the {args.admin_command} failed: {document.get('error')}")


def _not_the_gateways_metrics() -> None:
    """The run dir's metrics folder is the gateway's (app/metrics.py): the cache process, the fork server and engines
    inherit its variable but must not write there (vLLM would add its own metrics to the gateway's sums)."""
    import os

    from app.metrics import ENV

    os.environ.pop(ENV, None)


def _cache(args: argparse.Namespace) -> None:
    from cache.server import main as run_cache

    _not_the_gateways_metrics()
    run_cache(args.model, args.socket, device=args.device, dtype=args.dtype, backend=args.backend)


def _engine(args: argparse.Namespace) -> None:
    if args.lifeline is not None:  # first, in the main thread (it holds the lock until the process ends)
        from common.lifeline import hold

        hold(args.lifeline)
    from engine.worker import main as run_worker

    _not_the_gateways_metrics()
    code = run_worker(args.socket, args.config, drain_timeout=args.drain_timeout, heartbeat_path=args.heartbeat)
    if code:  # its front process did not end cleanly: a crash, for the supervisor
        raise SystemExit(code)


def _relay(args: argparse.Namespace) -> None:
    from app.relay.main import main as run_relay

    run_relay(args.control, args.listen_fd, args.index, args.board, args.drain_timeout)


def _fork_server(args: argparse.Namespace) -> None:
    from engine.fork_server import serve

    _not_the_gateways_metrics()
    serve(args.socket, child_main=main, backend=args.backend)  # a forked worker runs `warmgate engine ...`


def _print_check(path: Path) -> None:
    from cache.checkpoint.reader import read_checkpoint

    print("\n".join(read_checkpoint(path).summary()))


_USER_ERRORS = (("app.supervisor.cache", "CacheStartError"), ("app.supervisor.run_dir", "RunDirInUse"),
                ("app.supervisor.serve", "GatewayStartError"), ("cache.checkpoint.demo", "DemoSourceError"),
                ("cache.client", "CacheRefused"), ("cache.client", "CacheUnavailable"),
                ("cache.errors", "CheckpointError"), ("engine.weights", "WeightKeyMismatch"))  # fmt: skip


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's to fix: shown as one line, no traceback.

    Only modules already imported are looked in (an error's class was imported to be raised): a refusal at
    start must not import torch on its way out."""
    ours = tuple(getattr(sys.modules[module], name) for module, name in _USER_ERRORS if module in sys.modules)
    return (*ours, FileExistsError, FileNotFoundError, NotADirectoryError, PermissionError, ConnectionError,
            ValueError, TimeoutError, RestartFailed)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], None] = args.run
    try:
        run(args)
    except KeyboardInterrupt:
        print("warmgate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `warmgate status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
        return 0
    except Exception as exc:
        if isinstance(exc, _expected_errors()):
            print(f"warmgate: error: {exc}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
