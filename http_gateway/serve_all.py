"""`tpuserve serve` (what `make serve` runs): one gRPC backend process on GRPC_PORT and the gateway on PORT.

The backend is a child process (it owns JAX and the devices; the gateway process never imports JAX). The gateway's
/health answers 503 until the backend's gRPC health says SERVING (after warm-up). SIGTERM/SIGINT stops the
gateway, then the backend drains its in-flight requests and exits.

`--config FILE` goes to both processes: the backend reads its `engine:` and `server:` sections, the gateway its
`gateway:` section (a flat engine file goes to the backend only). Flags this command does not know are the
gateway's (`tpuserve gateway --help`): limits, CORS, HTTPS, request timeout; they are checked before the backend
starts."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("tpuserve.serve")


def _die_with_parent() -> None:
    """In the backend child: receive SIGTERM if this process dies without stopping it (Linux prctl)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def plan(argv: list[str] | None = None) -> tuple[list[str], argparse.Namespace]:
    """The backend's command line and the gateway's parsed settings; bad flags exit here, before anything runs.

    Ports and hosts: a flag, else its environment variable, else the config file's section, else the default."""
    p = argparse.ArgumentParser(
        prog="tpuserve serve",
        description=__doc__.split("\n\n")[0],
        epilog="Other flags are passed to the gateway; see `tpuserve gateway --help`.",
    )
    p.add_argument(
        "--host", default=os.environ.get("HOST"), help="gateway host ($HOST; else config, 0.0.0.0)"
    )
    p.add_argument(
        "--port", type=int, default=_env_int("PORT"), help="gateway port ($PORT; else config, 8000)"
    )
    p.add_argument(
        "--grpc-host",
        default=None,
        help="backend gRPC host (else the config's server.host, else 127.0.0.1: local clients only)",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=_env_int("GRPC_PORT"),
        help="backend gRPC port ($GRPC_PORT; else the config's server.port, else 50051)",
    )
    p.add_argument(
        "--model", default=None, help="GGUF file, HF directory or Orbax checkpoint (default: embedded)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML config (configs/*.yaml): engine:/server: sections, gateway: section",
    )
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (or $TPUSERVE_API_KEY)")
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
    args, gateway_extra = p.parse_known_args(argv)
    server: dict = {}
    gateway_config = None
    if args.config:
        from tpuserve.proto.settings import is_sectioned, read, section

        try:
            data = read(args.config)
            server = section(data, "server", path=args.config)
        except (OSError, ValueError) as e:
            p.error(str(e))
        # a flat file (no sections) is the engine's, as for `tpuserve grpc`; the gateway reads only a gateway:
        if is_sectioned(data):
            gateway_config = args.config
    grpc_host = args.grpc_host or server.get("host") or "127.0.0.1"
    grpc_port = args.grpc_port if args.grpc_port is not None else int(server.get("port") or 50051)
    metrics_port = args.metrics_port if args.metrics_port is not None else server.get("metrics_port")
    if metrics_port is None:
        metrics_port = grpc_port + 1

    gateway_argv = ["--backend", f"{_reachable(grpc_host)}:{grpc_port}"]
    for flag, value in (("--host", args.host), ("--port", args.port), ("--api-key", args.api_key)):
        if value is not None:
            gateway_argv += [flag, str(value)]
    if args.log_prompts:
        gateway_argv += ["--log-prompts"]
    if gateway_config:
        gateway_argv += ["--config", gateway_config]
    gateway_argv += gateway_extra
    from tpuserve.http_gateway.serve import parse_args

    gateway_args = parse_args(gateway_argv)  # bad gateway flags fail here, before the backend starts
    if server.get("tls_cert_file") and not (gateway_args.backend_tls or gateway_args.backend_tls_ca_file):
        log.warning(
            "the backend serves TLS but the gateway's backend_tls_* settings are unset: it cannot connect"
        )

    backend_cmd = [
        sys.executable,
        "-m",
        "tpuserve.grpc_service",
        "--host",
        grpc_host,
        "--port",
        str(grpc_port),
    ]
    if args.model:
        backend_cmd += ["--model", args.model]
    if args.config:
        backend_cmd += ["--config", args.config]
    backend_cmd += ["--metrics-port", str(metrics_port)]  # on the gRPC host
    if args.log_prompts:
        backend_cmd += ["--log-prompts"]
    return backend_cmd, gateway_args


def main(argv: list[str] | None = None) -> int:
    backend_cmd, gateway_args = plan(argv)
    from tpuserve.http_gateway.serve import run

    backend = subprocess.Popen(backend_cmd, preexec_fn=_die_with_parent)
    try:
        # uvicorn shuts down gracefully on SIGTERM/SIGINT; run() then exits by SystemExit (its handler for the
        # re-raised signal), so `finally` stops the backend. Should this process die first, the backend gets
        # SIGTERM from the kernel (_die_with_parent).
        run(gateway_args)
    finally:
        if backend.poll() is None:
            backend.send_signal(signal.SIGTERM)
            try:
                backend.wait(60)
            except subprocess.TimeoutExpired:
                backend.kill()
    return 0


def _reachable(host: str) -> str:
    """The address the gateway dials for a backend bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::", "[::]") else host
