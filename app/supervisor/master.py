"""`warmgate serve`: a small master that holds the run dir and the listening socket, and keeps a supervisor running.

    warmgate serve (this process: the lock, the socket, nothing else)
      └─ warmgate supervisor (the control plane, app/supervisor/serve.py), restarted when it dies
           ├─ relays, fork server, engines, cache: they outlive the supervisor and are adopted by the next

nginx's and gunicorn's shape: the process a container or a terminal watches does almost nothing, so almost
nothing can kill it, and everything else can die and come back without a refused connection:

* the supervisor dies (kill -9, a bug): the relays serve on with their last table and the engines with their
  requests; the master starts another supervisor (with backoff), which adopts them all;
* this process dies (kill -9): its supervisor dies with it (PR_SET_PDEATHSIG) and the rest serve on; a new
  `warmgate serve` on the run dir takes the listening socket from a relay (common/handoff.py) and adopts them;
* `warmgate upgrade` (SIGUSR2): this process re-executes itself (new code, same pid, the lock and the socket
  kept), has its supervisor hand over (it exits, leaving everything running) and starts a new one that adopts
  everything and replaces the relays with new ones, draining the old: no request fails;
* SIGTERM or SIGINT: the supervisor stops everything, in order; SIGHUP: it re-reads its config.

Every check a user can fail comes first, each as one line: the run dir (ours, not in use), the port; the
supervisor then checks the model, and its error ends this process with the same exit status.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from app.config import Settings, load_settings
from app.supervisor.run_dir import RunDir, url_for
from common.backoff import Backoff
from common.events import configure_logging, log_event, log_warning
from common.processes import die_with_parent
from common.uds import private_dir

log = logging.getLogger("warmgate.master")
INHERIT_ENV = "WARMGATE_MASTER_INHERIT"  # what an upgrade's re-executed master takes over (JSON)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2, signal.SIGCHLD)
HEALTHY_S = 60.0  # a supervisor that ran this long before it died was not crash-looping


class SupervisorExited(RuntimeError):
    """The first supervisor exited before it was ready (it printed why); ``code`` is its exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the supervisor exited with {code}")
        self.code = code


def main(argv: list[str], config_path: Path | None, **overrides: Any) -> int:
    """Run `warmgate serve` (``argv``: its options, passed on to each supervisor) until SIGTERM/SIGINT."""
    configure_logging()
    settings = load_settings(config_path, **overrides)
    private_dir(settings.run_dir)
    inherited = os.environ.pop(INHERIT_ENV, None)
    run_dir = RunDir(settings.run_dir)
    if inherited is None:
        run_dir.claim()
        child = None
        try:
            listener = _listener(settings)
        except BaseException:
            run_dir.release()
            raise
    else:  # re-executed by an upgrade: the lock, the socket and the running supervisor are ours already
        held = json.loads(inherited)
        run_dir.inherit(held["lock"])
        listener = socket.socket(fileno=held["listener"])
        os.set_inheritable(listener.fileno(), False)
        child = held["supervisor"]
    from common.proctitle import set_title

    set_title(f"serve {settings.run_dir}")
    run_dir.record_address(url_for(settings.gateway.host, listener.getsockname()[1]))
    master = Master(argv, settings, run_dir, listener, child)
    try:
        return master.run(upgrading=inherited is not None)
    finally:
        run_dir.release()


def _listener(settings: Settings) -> socket.socket:
    """The socket an earlier gateway's relays still accept on (no client is refused across the restart), else a
    new one; a busy port fails here, at once."""
    from app.supervisor.relays import open_listener
    from common import handoff

    gateway = settings.gateway
    listener = handoff.take(settings.run_dir)
    if listener is not None:
        port = listener.getsockname()[1]
        if gateway.port not in (0, port):
            listener.close()
            raise ConnectionError(f"the relays of an earlier gateway on {settings.run_dir} serve port {port}, not "
                                  f"{gateway.port}: run `warmgate stop --run-dir {settings.run_dir}` first, or use "
                                  f"--port {port}")  # fmt: skip
        log_event(log, "listener_taken_over", port=port)
        return listener
    try:
        return open_listener(gateway.host, gateway.port)
    except OSError as exc:
        raise ConnectionError(f"cannot listen on {gateway.host}:{gateway.port}: {exc.strerror or exc}") from None


class Master:
    def __init__(self, argv: list[str], settings: Settings, run_dir: RunDir, listener: socket.socket,
                 child: int | None) -> None:  # fmt: skip
        self.argv = argv
        self.settings = settings
        self.run_dir = run_dir
        self.listener = listener
        self.child = child  # the supervisor's pid
        self.child_started = time.monotonic()
        self.backoff = Backoff(0.5, 10.0)

    def run(self, upgrading: bool) -> int:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # taken with sigtimedwait: no handler runs mid-step
        if upgrading:
            self._hand_over()
            self._start(upgrade=True)
        else:
            self._start(upgrade=False)
            outcome = self._until_ready()
            if isinstance(outcome, signal.Signals):
                return self._stop(outcome)
            if outcome is not None:
                raise SupervisorExited(outcome)
        while True:
            info = signal.sigtimedwait(SIGNALS, 1.0)
            if info is None or info.si_signo == signal.SIGCHLD:
                self._reap()
            elif info.si_signo in (signal.SIGTERM, signal.SIGINT):
                return self._stop(signal.Signals(info.si_signo))
            elif info.si_signo == signal.SIGHUP:
                self._tell(signal.SIGHUP)
            elif info.si_signo == signal.SIGUSR2:
                self._upgrade()

    # -- the supervisor ---------------------------------------------------------------------------------

    def _start(self, upgrade: bool) -> None:
        """Start a supervisor: it inherits the listening socket and a pipe to say it is ready; it dies with us."""
        ready_r, ready_w = os.pipe()
        argv = [sys.executable, "-m", "app.cli", "supervisor", *self.argv, "--listen-fd", str(self.listener.fileno()),
                "--ready-fd", str(ready_w), *(["--upgrade"] if upgrade else [])]  # fmt: skip
        pid = os.fork()
        if pid == 0:  # the child: nothing but exec (the parent is single-threaded)
            try:
                die_with_parent()
                signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
                os.set_inheritable(self.listener.fileno(), True)
                os.set_inheritable(ready_w, True)
                os.close(ready_r)
                os.execv(sys.executable, argv)
            finally:
                os._exit(127)
        os.close(ready_w)
        self.ready = ready_r
        self.child, self.child_started = pid, time.monotonic()
        log_event(log, "supervisor_started", pid=pid, upgrade=upgrade)

    def _until_ready(self) -> int | signal.Signals | None:
        """Wait until the first supervisor is ready (None) or exits (its exit status), or a stop is asked for (the
        signal: Ctrl-C during start-up)."""
        while True:
            readable, _, _ = select.select([self.ready], [], [], 0.1)
            if readable and os.read(self.ready, 1):
                return None
            info = signal.sigtimedwait((signal.SIGTERM, signal.SIGINT), 0)  # first: Ctrl-C also ends the supervisor
            if info is not None:
                return signal.Signals(info.si_signo)
            code = self._exited(block=False)
            if code is not None:
                return code

    def _exited(self, block: bool) -> int | None:
        """The supervisor's exit status, once it has exited (``block``: wait for it)."""
        if self.child is None:
            return None
        pid, status = os.waitpid(self.child, 0 if block else os.WNOHANG)
        if pid == 0:
            return None
        self.child = None
        os.close(self.ready)
        return os.waitstatus_to_exitcode(status)

    def _reap(self) -> None:
        """A supervisor that died is started again (with backoff): it adopts what the last one ran. Other children
        are reaped too (as PID 1 of a container without an init, the orphans of a dead supervisor are ours)."""
        code = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == self.child:
                self.child = None
                os.close(self.ready)
                code = os.waitstatus_to_exitcode(status)
        if code is None:
            return
        log_warning(log, "supervisor_exited", code=code)
        if time.monotonic() - self.child_started > HEALTHY_S:
            self.backoff.succeeded()
        delay = self.backoff.failed()
        deadline = time.monotonic() + delay
        while (left := deadline - time.monotonic()) > 0:  # a stop asked for meanwhile is taken at once
            info = signal.sigtimedwait((signal.SIGTERM, signal.SIGINT), left)
            if info is not None:
                signal.raise_signal(info.si_signo)  # blocked: taken again by the main loop, which stops
                return
        self._start(upgrade=False)

    def _tell(self, sig: signal.Signals) -> None:
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, sig)

    # -- stop and upgrade ---------------------------------------------------------------------------------

    def _stop(self, sig: signal.Signals) -> int:
        """The supervisor stops everything in order; what it leaves (it was not running, or it was stopped before it
        could, during its start-up) is stopped here."""
        log_event(log, "stopping", signal=sig.name)
        if self.child is not None:
            self._tell(signal.SIGTERM)
            code = self._exited(block=True)
            if code != 0:
                log_event(log, "supervisor_stopped", code=code)
        from app.supervisor.sweep import remove_files, stop_processes

        stop_processes(self.run_dir.path, self.settings.restart.drain_timeout, spare=frozenset({os.getpid()}))
        remove_files(self.run_dir.path)
        return 0

    def _upgrade(self) -> None:
        """Re-execute this program (its new code), keeping the pid, the lock, the socket and the supervisor."""
        log_event(log, "upgrade", phase="exec", supervisor=self.child)
        lock = self.run_dir.lock_fd
        assert lock is not None
        for fd in (lock, self.listener.fileno()):
            os.set_inheritable(fd, True)
        os.environ[INHERIT_ENV] = json.dumps({"lock": lock, "listener": self.listener.fileno(),
                                              "supervisor": self.child})  # fmt: skip
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        os.execv(sys.executable, [sys.executable, "-m", "app.cli", "serve", *self.argv])

    def _hand_over(self) -> None:
        """After the re-exec: the running supervisor exits, leaving its processes serving for the next."""
        if self.child is None:
            return
        self.ready = os.open(os.devnull, os.O_RDONLY)  # its pipe went with the old program image
        self._tell(signal.SIGUSR2)
        code = self._exited(block=True)
        log_event(log, "upgrade", phase="handed_over", code=code)
