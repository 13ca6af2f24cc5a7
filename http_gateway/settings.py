"""The gateway's settings: `GatewaySettings`, the gateway's flags (`parser`: `--backend host:port [--backend
...] [--host H] [--port 8000] [--api-key K] ...`; the API key may also come from $TPUSERVE_API_KEY), and
`parse_args`: the flags on the defaults, for a run of this layer on its own (`python -m
tpuserve.http_gateway.serve`).

`tpuserve gateway` and `tpuserve serve` (cli/gateway.py) also read the YAML `--config` file, with the
flags on top: its keys are these fields, the flags' long names with underscores (e.g. `backend: [host:port]`,
`max_body_bytes: 4194304`, `cors_allow_origins: [...]`), under a `gateway:` section when the file also holds
the backend's `engine:`/`server:` sections (see configs/gateway.yaml)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from tpuserve.http_gateway.backends import BackendTLS
from tpuserve.http_gateway.observability import Limits

API_KEY_ENV = "TPUSERVE_API_KEY"
ADMIN_KEY_ENV = "TPUSERVE_ADMIN_KEY"  # the backend reads the same variable (grpc_service/settings.py)


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway process's settings; the YAML `gateway:` keys are these fields, the flags their long names."""

    backend: tuple[str, ...] = ()  # gRPC backend addresses, host:port (round-robin)
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)
    # POST /v1/admin/update_weights' bearer key, handed on to the backends (unset: no such route)
    admin_key: str | None = field(default=None, repr=False)
    log_level: str = "info"
    log_format: str = "json"
    log_prompts: bool = False
    max_body_bytes: int = Limits.max_body_bytes
    max_concurrent_requests: int = Limits.max_concurrent_requests
    max_n: int = Limits.max_n
    request_timeout: float | None = None  # seconds; the backend call's gRPC deadline
    cors_allow_origins: tuple[str, ...] = ()
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    backend_tls: bool = False
    backend_tls_ca_file: str | None = None
    backend_tls_cert_file: str | None = None
    backend_tls_key_file: str | None = None
    backend_tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, not {self.log_format!r}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive seconds (or unset)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("HTTPS needs both --tls-cert-file and --tls-key-file")
        try:
            self.backend_tls_config()  # BackendTLS checks its certificate/key pair
        except ValueError as e:
            raise ValueError(f"--backend-tls-*: {e}") from None

    def limits(self) -> Limits:
        return Limits(
            max_body_bytes=self.max_body_bytes,
            max_concurrent_requests=self.max_concurrent_requests,
            max_n=self.max_n,
            request_timeout_s=self.request_timeout,
        )

    def backend_tls_config(self) -> BackendTLS | None:
        """TLS to the backends when `backend_tls` or any backend_tls_* path is set."""
        fields = {
            "ca_file": self.backend_tls_ca_file,
            "cert_file": self.backend_tls_cert_file,
            "key_file": self.backend_tls_key_file,
            "server_name": self.backend_tls_server_name,
        }
        if not self.backend_tls and all(v is None for v in fields.values()):
            return None
        return BackendTLS(**fields)


def defaults() -> GatewaySettings:
    """The defaults, with the API and admin keys from $TPUSERVE_API_KEY and $TPUSERVE_ADMIN_KEY when set."""
    return GatewaySettings(
        api_key=os.environ.get(API_KEY_ENV) or None, admin_key=os.environ.get(ADMIN_KEY_ENV) or None
    )


def parser(prog: str = "python -m tpuserve.http_gateway.serve") -> argparse.ArgumentParser:
    """The gateway's flags (`dest` = the field's name, None when not given)."""
    p = argparse.ArgumentParser(prog=prog, description="The OpenAI-compatible HTTP gateway to gRPC backends.")
    p.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="gRPC backend address; repeat for several (round-robin)",
    )
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--admin-key",
        default=None,
        help=f"serve POST /v1/admin/update_weights under 'Authorization: Bearer KEY' (default: ${ADMIN_KEY_ENV}; "
        "unset: off)",
    )
    p.add_argument("--log-level", default=None)
    p.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=None,
        help="default json (the tpuserve command; a run of this module alone logs text)",
    )
    p.add_argument(
        "--log-prompts", action="store_true", default=None, help="include prompts in the request log lines"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 4 MiB)"
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="more /v1/* requests in flight get 429 (256)",
    )
    p.add_argument("--max-n", type=int, default=None, help="larger n / best_of get 400 (default 16)")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a generation may take, queueing included (the backend call's gRPC deadline; then 504); "
        "default none",
    )
    p.add_argument(
        "--cors-allow-origin",
        dest="cors_allow_origins",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="allow browser calls from ORIGIN (repeat; '*' = any); CORS is off without it",
    )
    _add_tls_flags(p)
    return p


def _add_tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert-file", default=None, help="serve HTTPS with this PEM certificate (chain)")
    p.add_argument("--tls-key-file", default=None, help="the PEM private key of --tls-cert-file")
    p.add_argument(
        "--backend-tls", action="store_true", default=None, help="reach the backends over TLS (system roots)"
    )
    p.add_argument("--backend-tls-ca-file", default=None, help="PEM roots for the backends' certificates")
    p.add_argument("--backend-tls-cert-file", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--backend-tls-key-file", default=None, help="the client certificate's private key")
    p.add_argument(
        "--backend-tls-server-name", default=None, help="name to check in the backends' certificates"
    )


def parse_args(argv: Sequence[str] | None) -> GatewaySettings:
    """The flags that were given on the defaults (no settings file: `tpuserve gateway --config` reads one). A
    bad setting exits with a usage error naming it."""
    p = parser()
    ns = p.parse_args(argv)
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items() if v is not None}
    try:
        found = dataclasses.replace(defaults(), **given)
    except ValueError as e:
        p.error(str(e))
    if not found.backend:
        p.error("at least one --backend is required")
    return found
