"""`tpuserve serve` (what `make serve` runs): one gRPC backend process on GRPC_PORT and the gateway on PORT.

The backend is a child process (`python -m tpuserve.cli grpc`: it owns JAX and the devices); this process
runs the gateway (`tpuserve.http_gateway.serve`) and never imports JAX; both log JSON lines. The gateway's
/health answers 503 until the backend's gRPC health says SERVING (after warm-up). SIGTERM/SIGINT stops the
gateway, then the backend drains its in-flight requests and exits. The threads of each process are listed in
http_gateway/serve.py and grpc_service/server.py.

`--config FILE` goes to both processes: the backend reads its `engine:` and `server:` sections, the gateway its
`gateway:` section (a flat engine file goes to the backend only). Flags this command does not know are the
gateway's (`tpuserve gateway --help`): limits, CORS, HTTPS, request timeout. Both processes' settings are
checked before the backend starts."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

from tpuserve.cli import backend as backend_command
from tpuserve.cli import gateway as gateway_command
from tpuserve.cli import settings
from tpuserve.grpc_service.settings import (
    ADMIN_KEY_ENV,
    ServerSettings,
    add_names_flags,
    add_quantization_flag,
    add_rescore_flag,
)
from tpuserve.http_gateway.settings import GatewaySettings

log = logging.getLogger("tpuserve.serve")

LOCAL_HOST = "127.0.0.1"  # the backend's default bind under this command: local clients only (the gateway)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tpuserve serve",
        description=__doc__.split("\n\n")[0],
        epilog="Other flags are passed to the gateway; see `tpuserve gateway --help`.",
    )
    p.add_argument(
        "--host",
        default=os.environ.get("HOST"),
        help=f"gateway host ($HOST; else config, {GatewaySettings.host})",
    )
    p.add_argument(
        "--port",
        type=int,
        default=_env_int("PORT"),
        help=f"gateway port ($PORT; else config, {GatewaySettings.port})",
    )
    p.add_argument(
        "--grpc-host",
        default=None,
        help=f"backend gRPC host (else the config's server.host, else {LOCAL_HOST}: local clients only)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=_env_int("GRPC_PORT"),
        help=f"backend gRPC port ($GRPC_PORT; else the config's server.port, else {ServerSettings.port})",
    )
    p.add_argument(
        "--model", default=None, help="GGUF file, HF directory or Orbax checkpoint (default: embedded)"
    )
    add_quantization_flag(p)
    p.add_argument(
        "--config",
        default=None,
        help="YAML config (configs/*.yaml): engine:/server: sections, gateway: section",
    )
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (or $TPUSERVE_API_KEY)")
    add_names_flags(p)
    add_rescore_flag(p)
    p.add_argument("--weight-version", default=None, help="the version of the weights served at start")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("METRICS_PORT"),
        help="backend Prometheus metrics HTTP port ($METRICS_PORT; else the config's server.metrics_port, else "
        "GRPC_PORT + 1; 0 = off); the gateway's are at /metrics",
    )
    p.add_argument(
        "--log-prompts", action="store_true", help="include prompts in both processes' request logs"
    )
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="a process group's coordinator, for the backend (process 0: `make serve-multihost`)")  # fmt: skip
    return p


def _backend_server(args: argparse.Namespace) -> ServerSettings:
    """The backend's host and ports: a flag (or its environment variable), else the config's `server:` section,
    else this command's defaults: LOCAL_HOST (local clients only), metrics on GRPC_PORT + 1."""
    flags = {"host": args.grpc_host or None, "port": args.grpc_port, "metrics_port": args.metrics_port}
    server = settings.load(ServerSettings(host=LOCAL_HOST), args.config, "server", flags)
    if server.metrics_port is None:
        server = dataclasses.replace(server, metrics_port=server.port + 1)
    return server


def _backend_argv(args: argparse.Namespace, server: ServerSettings) -> list[str]:
    argv = ["--host", server.host, "--port", str(server.port)]
    if args.model:
        argv += ["--model", args.model]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    if args.config:
        argv += ["--config", args.config]
    argv += ["--metrics-port", str(server.metrics_port)]  # on the gRPC host
    if args.log_prompts:
        argv += ["--log-prompts"]
    if args.coordinator:
        argv += ["--coordinator", args.coordinator]
    if args.served_model_name:
        argv += ["--served-model-name", *args.served_model_name]
    if args.weight_version:
        argv += ["--weight-version", args.weight_version]
    if args.rescore_exact:
        argv += ["--rescore-exact"]
    return argv  # the admin key goes by the environment (main), not on a command line others can read


def _gateway_argv(args: argparse.Namespace, server: ServerSettings, extra: list[str]) -> list[str]:
    argv = ["--backend", f"{_reachable(server.host)}:{server.port}"]
    flags = (
        ("--host", args.host),
        ("--port", args.port),
        ("--api-key", args.api_key),
        ("--admin-key", args.admin_key),
    )
    for flag, value in flags:
        if value is not None:
            argv += [flag, str(value)]
    if args.log_prompts:
        argv += ["--log-prompts"]
    # a flat file (no sections) is the engine's, as for `tpuserve grpc`; the gateway reads only a gateway:
    if args.config and settings.is_sectioned(settings.read(args.config)):
        argv += ["--config", args.config]
    return argv + extra


def plan(argv: Sequence[str] | None = None) -> tuple[list[str], GatewaySettings]:
    """The backend's command line and the gateway's settings; bad flags or settings of either process exit here,
    before anything runs."""
    p = _parser()
    args, gateway_extra = p.parse_known_args(argv)
    try:
        server = _backend_server(args)
        gateway_argv = _gateway_argv(args, server, gateway_extra)
    except (OSError, ValueError) as e:
        p.error(str(e))
    backend_argv = _backend_argv(args, server)
    backend_command.parse_args(backend_argv)  # exits on a bad engine:/server: setting
    gateway = gateway_command.parse_args(gateway_argv)  # exits on a bad gateway flag or setting
    if server.tls_cert_file and gateway.backend_tls_config() is None:
        log.warning(
            "the backend serves TLS but the gateway's backend_tls_* settings are unset: it cannot connect"
        )
    return [sys.executable, "-m", "tpuserve.cli", "grpc", *backend_argv], gateway


def main(argv: Sequence[str] | None = None) -> int:
    backend_cmd, gateway = plan(argv)
    env = dict(os.environ)
    if gateway.admin_key:  # the backend checks the key the gateway hands on
        env[ADMIN_KEY_ENV] = gateway.admin_key
    backend = subprocess.Popen(backend_cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509 (no threads yet)
    died: list[int] = []  # the backend's exit code, when it exited on its own

    def watch() -> None:  # a backend that exits by itself (a failed process group, a crash) stops the gateway
        code = backend.wait()
        if not stopping.is_set():
            died.append(code)
            log.error("the backend exited (code %d): stopping the gateway", code)
            os.kill(os.getpid(), signal.SIGTERM)

    stopping = threading.Event()
    threading.Thread(target=watch, name="backend-watch", daemon=True).start()
    try:
        # uvicorn shuts down gracefully on SIGTERM/SIGINT; the gateway then exits by SystemExit (its handler for
        # the re-raised signal), so `finally` stops the backend. Should this process die first, the backend gets
        # SIGTERM from the kernel (_die_with_parent).
        gateway_command.serve(gateway)
    except SystemExit:
        if not died:
            raise
    finally:
        stopping.set()
        if backend.poll() is None:
            backend.send_signal(signal.SIGTERM)
            try:
                backend.wait(60)
            except subprocess.TimeoutExpired:
                backend.kill()
    return (died[0] or 1) if died else 0


def _die_with_parent() -> None:
    """In the backend child: receive SIGTERM if this process dies without stopping it (Linux prctl)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _reachable(host: str) -> str:
    """The address the gateway dials for a backend bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::", "[::]") else host
