"""The servers under test, as subprocesses on free loopback ports: `tpuserve serve` (gateway + backend) and,
with `--llama-server BIN`, llama.cpp's `llama-server` on the same GGUF. Each runs in a session of its own, so
stopping it (SIGTERM to its process group, SIGKILL after a grace period) takes its children with it; `Servers`
stops every one it started on exit, Ctrl-C included. Their output goes to log files in a work directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Self

import yaml

from bench import clients

COMPILES_METRIC = "tpuserve_backend_xla_compiles_total"
ACTIVE_METRIC = "tpuserve_backend_active_slots"
QUEUE_METRIC = "tpuserve_backend_queue_depth"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P + 1 also free (tpuserve's backend serves its metrics on GRPC_PORT + 1)."""
    for _ in range(50):
        p = free_port()
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p + 1))
            return p
    raise RuntimeError("no two adjacent free ports")


def tpuserve_bin() -> str:
    """The `tpuserve` console script next to this interpreter (the .venv-test one under `make bench`)."""
    here = pathlib.Path(sys.executable).parent / "tpuserve"
    return str(here) if here.exists() else "tpuserve"


@dataclass
class Server:
    name: str
    base_url: str
    argv: list[str]
    log_path: pathlib.Path
    metrics_url: str | None = None  # tpuserve backend's Prometheus endpoint
    env: dict[str, str] | None = None  # added to this process's environment
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)  # fmt: skip
        log.close()

    def wait_ready(self, timeout_s: float) -> float:
        """Poll GET /health until 200; returns the seconds it took. Raises if the process exits or time runs out
        (with the end of its log)."""
        start = time.monotonic()
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            status, _ = asyncio.run(clients.get_text(self.base_url, "/health", timeout=2.0))
            if status == 200:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM to the server's process group, then SIGKILL after `grace_s`; its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)

    def busy(self) -> bool | None:
        """Whether the server holds a request now (tpuserve: the backend's active slots or queue depth;
        llama-server: a slot `is_processing` in GET /slots); None when it cannot tell."""
        if self.metrics_url is not None:
            status, text = asyncio.run(clients.get_text(self.metrics_url, "/metrics"))
            if status != 200:
                return None
            gauges = [clients.prometheus_sum(text, m) for m in (ACTIVE_METRIC, QUEUE_METRIC)]
            return None if None in gauges else any(g > 0 for g in gauges)
        status, text = asyncio.run(clients.get_text(self.base_url, "/slots"))
        if status != 200:
            return None
        try:
            return any(s.get("is_processing") for s in json.loads(text))
        except (ValueError, AttributeError):
            return None

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        """Wait until `busy()` is False (cancelled streams take a moment to leave); False on time-out. A server
        that cannot tell gets a fixed 2 s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = self.busy()
            if busy is None:
                time.sleep(2.0)
                return True
            if not busy:
                return True
            time.sleep(0.25)
        return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def metric(self, name: str) -> float | None:
        """A tpuserve backend metric now (None: no metrics endpoint, or it did not answer)."""
        if self.metrics_url is None:
            return None
        status, text = asyncio.run(clients.get_text(self.metrics_url, "/metrics"))
        return clients.prometheus_sum(text, name) if status == 200 else None

    def compiles(self) -> float | None:
        """tpuserve_backend_xla_compiles_total now."""
        return self.metric(COMPILES_METRIC)


def config_variants(
    workdir: pathlib.Path, base: str | None, stem: str, variants: dict[str, dict[str, Any]]
) -> dict[str, str]:
    """A config file per variant (name -> the path of `{stem}-{name}.yaml`): `base`'s settings (or the defaults)
    with the variant's `engine:` keys on top, for paired servers that differ in those keys only."""
    doc: dict[str, Any] = yaml.safe_load(pathlib.Path(base).read_text()) if base else {}
    out = {}
    for name, engine in variants.items():
        path = workdir / f"{stem}-{name}.yaml"
        path.write_text(yaml.safe_dump({**doc, "engine": {**(doc.get("engine") or {}), **engine}}))
        out[name] = str(path)
    return out


def tpuserve(workdir: pathlib.Path, config: str | None, name: str = "tpuserve",
             env: dict[str, str] | None = None) -> Server:  # fmt: skip
    """`tpuserve serve` on free ports, its backend metrics on GRPC_PORT + 1; default settings unless `config`."""
    port, grpc_port = free_port(), free_port_pair()
    argv = [tpuserve_bin(), "serve", "--port", str(port), "--grpc-port", str(grpc_port)]
    argv += ["--metrics-port", str(grpc_port + 1)]
    if config:
        argv += ["--config", config]
    return Server(
        name=name,
        base_url=f"http://127.0.0.1:{port}",
        argv=argv,
        log_path=workdir / f"{name}.log",
        metrics_url=f"http://127.0.0.1:{grpc_port + 1}",
        env=env,
    )


@dataclass(frozen=True)
class LlamaSettings:
    """llama-server's flags: 2 threads like the 2-core machine, 64 slots with continuous batching. `ctx` is the
    total context, shared by the slots (ctx / slots each): 64 x 384 holds a ~15-token prompt + 256 tokens."""

    threads: int = 2
    slots: int = 64
    ctx: int = 64 * 384


def llama(workdir: pathlib.Path, binary: str, gguf: str, settings: LlamaSettings = LlamaSettings()) -> Server:
    port = free_port()
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(settings.threads)]
    argv += ["-np", str(settings.slots), "-c", str(settings.ctx), "--cont-batching"]
    return Server(
        name="llama-server", base_url=f"http://127.0.0.1:{port}", argv=argv, log_path=workdir / "llama.log"
    )


class Servers(contextlib.AbstractContextManager):
    """Starts servers and stops all of them on exit (normal, exception, Ctrl-C, SIGTERM to this process)."""

    def __init__(self) -> None:
        self.started: list[Server] = []
        self._old_term = None

    def __enter__(self) -> Self:
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def start(self, server: Server) -> Server:
        self.started.append(server)
        server.start()
        return server

    def __exit__(self, *exc) -> None:
        for s in reversed(self.started):
            s.stop()
        signal.signal(signal.SIGTERM, self._old_term or signal.SIG_DFL)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
