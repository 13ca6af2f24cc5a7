"""`tpuserve gateway --backend host:port [--backend ...] [--host H] [--port 8000] [--api-key K] [--config YAML]`:
run the OpenAI-compatible gateway with uvicorn. The API key may also come from $TPUSERVE_API_KEY.

Settings come from flags, then the optional YAML `--config` (keys = the flags' long names with underscores,
e.g. `backend: [host:port]`, `max_body_bytes: 4194304`, `cors_allow_origins: [...]`; under a `gateway:` section
when the file also holds the backend's `engine:`/`server:` sections; see configs/gateway.yaml), then the
defaults."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import uvicorn
from tpuserve.http_gateway.app import create_app
from tpuserve.http_gateway.backends import BackendTLS
from tpuserve.http_gateway.observability import Limits
from tpuserve.proto import jsonlog
from tpuserve.proto.settings import merge

API_KEY_ENV = "TPUSERVE_API_KEY"

DEFAULTS: dict[str, Any] = {
    "backend": None,
    "host": "0.0.0.0",
    "port": 8000,
    "api_key": None,
    "log_level": "info",
    "log_format": "json",
    "log_prompts": False,
    "max_body_bytes": Limits.max_body_bytes,
    "max_concurrent_requests": Limits.max_concurrent_requests,
    "max_n": Limits.max_n,
    "request_timeout": None,
    "cors_allow_origins": [],
    "tls_cert_file": None,
    "tls_key_file": None,
    "backend_tls": False,
    "backend_tls_ca_file": None,
    "backend_tls_cert_file": None,
    "backend_tls_key_file": None,
    "backend_tls_server_name": None,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tpuserve gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="gateway YAML (flags override it)")
    parser.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="gRPC backend address; repeat for several (round-robin)",
    )
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--log-level", default=None)
    parser.add_argument("--log-format", choices=("json", "text"), default=None, help="default json")
    parser.add_argument(
        "--log-prompts", action="store_true", default=None, help="include prompts in the request log lines"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 4 MiB)"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="more /v1/* requests in flight get 429 (256)",
    )
    parser.add_argument("--max-n", type=int, default=None, help="larger n / best_of get 400 (default 16)")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a generation may take, queueing included (the backend call's gRPC deadline; then 504); "
        "default none",
    )
    parser.add_argument(
        "--cors-allow-origin",
        dest="cors_allow_origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="allow browser calls from ORIGIN (repeat; '*' = any); CORS is off without it",
    )
    parser.add_argument("--tls-cert-file", default=None, help="serve HTTPS with this PEM certificate (chain)")
    parser.add_argument("--tls-key-file", default=None, help="the PEM private key of --tls-cert-file")
    parser.add_argument(
        "--backend-tls", action="store_true", default=None, help="reach the backends over TLS (system roots)"
    )
    parser.add_argument(
        "--backend-tls-ca-file", default=None, help="PEM roots for the backends' certificates"
    )
    parser.add_argument("--backend-tls-cert-file", default=None, help="client certificate (mutual TLS)")
    parser.add_argument("--backend-tls-key-file", default=None, help="the client certificate's private key")
    parser.add_argument(
        "--backend-tls-server-name", default=None, help="name to check in the backends' certificates"
    )
    args = list(argv) if argv is not None else None
    if args and args[0] == "gateway":
        args = args[1:]
    ns = parser.parse_args(args)
    defaults = {**DEFAULTS, "api_key": os.environ.get(API_KEY_ENV) or None}
    try:  # a file with only gateway keys (no sections) is read as the gateway's
        settings = merge(defaults, ns.config, "gateway", vars(ns), flat=True)
    except ValueError as e:
        parser.error(str(e))
    if settings["request_timeout"] is not None and float(settings["request_timeout"]) <= 0:
        parser.error("--request-timeout must be positive seconds (or unset)")
    for key in ("backend", "cors_allow_origins"):
        if isinstance(settings[key], str):
            settings[key] = [settings[key]]
    if not settings["backend"]:
        parser.error("at least one --backend (or `backend:` in --config) is required")
    if (settings["tls_cert_file"] is None) != (settings["tls_key_file"] is None):
        parser.error("HTTPS needs both --tls-cert-file and --tls-key-file")
    args = argparse.Namespace(**settings)
    try:
        backend_tls_of(args)  # BackendTLS checks its certificate/key pair
    except ValueError as e:
        parser.error(f"--backend-tls-*: {e}")
    return args


def backend_tls_of(args: argparse.Namespace) -> BackendTLS | None:
    """TLS to the backends when `backend_tls` or any backend_tls_* path is set."""
    fields = {
        "ca_file": args.backend_tls_ca_file,
        "cert_file": args.backend_tls_cert_file,
        "key_file": args.backend_tls_key_file,
        "server_name": args.backend_tls_server_name,
    }
    if not args.backend_tls and all(v is None for v in fields.values()):
        return None
    return BackendTLS(**fields)


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(
        max_body_bytes=int(args.max_body_bytes),
        max_concurrent_requests=int(args.max_concurrent_requests),
        max_n=int(args.max_n),
        request_timeout_s=None if args.request_timeout is None else float(args.request_timeout),
    )


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


def run(args: argparse.Namespace) -> None:
    """Serve until SIGTERM/SIGINT with settings from `parse_args`."""
    jsonlog.setup(args.log_level, args.log_format)
    app = create_app(
        args.backend,
        api_key=args.api_key,
        limits=limits_of(args),
        log_prompts=bool(args.log_prompts),
        cors_allow_origins=args.cors_allow_origins,
        backend_tls=backend_tls_of(args),
    )
    # uvicorn re-raises SIGTERM with the previous handler after its graceful shutdown: exit 0 there.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Our handler formats uvicorn's logs too; our own request lines replace its access log.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,
        access_log=False,
        ssl_certfile=args.tls_cert_file,
        ssl_keyfile=args.tls_key_file,
    )


if __name__ == "__main__":
    main()
