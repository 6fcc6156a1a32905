"""A real `caldrix serve` process on a loopback port, for tests that speak HTTP to it.

    with ServerProcess.start(model_dir, "--dtype", "float32") as srv:
        httpx.get(srv.url + "/healthz")

`start` runs `python -m caldrix serve MODEL --port <free port> [flags]` with the test's own
interpreter, reads the server's stderr on a thread (so the pipe never fills), and returns once the
server prints its "caldrix: listening on ..." line and answers /healthz. A server that exits or
does not get there in time is a test failure that shows the server's stderr. `stop` sends
SIGTERM, waits, and kills on a timeout; it returns the exit status.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

LISTENING = re.compile(r"caldrix: listening on (http://\S+)/v1")
CONTEXT = re.compile(r"caldrix: context (\d+) rows per sequence")


def hold_slot(url: str, model: str, stop: threading.Event, max_tokens: int = 1000,
              started: threading.Event | None = None) -> None:
    """Stream one long completion from the server at `url`, holding a slot until `stop` is set;
    leaving closes the connection, and the scheduler frees the slot within a step. `started`,
    where given, is set at the first token: from then on the completion holds a slot. Run it
    on a thread of its own."""
    body = {"model": model, "prompt": "Count: 1 2 3", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if started is not None and line.startswith("data: "):
                started.set()
            if stop.is_set():
                return


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `caldrix serve` subprocess. Use `start`; stop it with `stop` (or a `with` block)."""

    def __init__(self, proc: subprocess.Popen, port: int, args: list[str]) -> None:
        self.proc = proc
        self.port = port
        self.args = args
        self.url = f"http://127.0.0.1:{port}"  # the root; the API is under /v1
        self._lines: list[str] = []
        self.exit_status_before_ready: int | None = None
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    # -- start ------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        model: str | os.PathLike[str] | None,
        *flags: str,
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        before: str | None = None,
    ) -> ServerProcess:
        """Start `caldrix serve [model] --port P *flags` and wait until it serves. `before`:
        Python run in the server's process before the command (to shorten a limit, say).

        Retries once on another port when the chosen one was taken between picking and binding.
        """
        last: ServerProcess | None = None
        for _ in range(2):
            port = free_port()
            args = [sys.executable, "-m", "caldrix", "serve"] if before is None else [
                sys.executable, "-c", f"{before}\nimport runpy, sys\nsys.argv[0] = 'caldrix'\n"
                "runpy.run_module('caldrix', run_name='__main__', alter_sys=True)", "serve"]
            if model is not None:
                args.append(str(model))
            args += ["--port", str(port), *flags]
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                encoding="utf-8",
                errors="replace",
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                cwd=Path(__file__).resolve().parent.parent,
            )
            srv = cls(proc, port, args)
            if srv._wait_ready(timeout):
                return srv
            srv.stop(timeout=10)
            last = srv
            if "address already in use" not in srv.stderr.lower():
                break
        assert last is not None
        why = (f"exited with status {last.exit_status_before_ready} before it was ready"
               if last.exit_status_before_ready is not None
               else f"was not ready within {timeout:.0f} s")
        pytest.fail(
            f"caldrix serve {why}; command: {' '.join(last.args)}\n"
            f"--- server stderr ---\n{last.stderr}",
            pytrace=False,
        )

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.exit_status_before_ready = self.proc.returncode
                self._reader.join(timeout=5)
                return False
            if LISTENING.search(self.stderr):
                try:
                    if httpx.get(self.url + "/healthz", timeout=5).text == "ok":
                        return True
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        return False

    # -- what it said -----------------------------------------------------------------------

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._lock:
                self._lines.append(line)

    @property
    def stderr(self) -> str:
        with self._lock:
            return "".join(self._lines)

    @property
    def context(self) -> int:
        """The rows per sequence the server announced."""
        m = CONTEXT.search(self.stderr)
        assert m, f"no context line in the server's stderr:\n{self.stderr}"
        return int(m.group(1))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    # -- stop -------------------------------------------------------------------------------

    def terminate(self) -> None:
        """Send SIGTERM without waiting."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after `timeout` seconds."""
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=5)  # its last lines are in self.stderr before anyone looks
        return status

    def stop(self, timeout: float = 45.0) -> int:
        """SIGTERM, wait up to `timeout` s, then SIGKILL. Returns the exit status."""
        self.terminate()
        status = self.wait(timeout)
        if status is None:
            self.proc.kill()
            status = self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        return status

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
