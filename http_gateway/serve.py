"""`tpuserve gateway --backend host:port [--backend ...] [--host H] [--port 8000] [--api-key K] [--config YAML]`:
run the OpenAI-compatible gateway with uvicorn. The API key may also come from $TPUSERVE_API_KEY.

Settings come from flags, then the optional YAML `--config` (keys = the flags' long names with underscores,
e.g. `backend: [host:port]`, `max_body_bytes: 4194304`; see configs/gateway.yaml), then the defaults."""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
from typing import Any

import uvicorn
import yaml
from tpuserve.http_gateway.app import create_app
from tpuserve.http_gateway.observability import Limits
from tpuserve.proto import jsonlog

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
    args = list(argv) if argv is not None else None
    if args and args[0] == "gateway":
        args = args[1:]
    ns = parser.parse_args(args)
    settings = dict(DEFAULTS)
    settings["api_key"] = os.environ.get(API_KEY_ENV) or None
    if ns.config:
        data = yaml.safe_load(pathlib.Path(ns.config).read_text()) or {}
        data = data.get("gateway", data)
        if not isinstance(data, dict):
            parser.error(f"{ns.config}: expected a mapping of gateway settings")
        unknown = sorted(set(data) - set(DEFAULTS))
        if unknown:
            parser.error(f"{ns.config}: unknown setting(s) {', '.join(unknown)}")
        settings.update({k: v for k, v in data.items() if v is not None})
    settings.update({k: v for k, v in vars(ns).items() if k in DEFAULTS and v is not None})
    if isinstance(settings["backend"], str):
        settings["backend"] = [settings["backend"]]
    if not settings["backend"]:
        parser.error("at least one --backend (or `backend:` in --config) is required")
    return argparse.Namespace(**settings)


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(
        max_body_bytes=int(args.max_body_bytes),
        max_concurrent_requests=int(args.max_concurrent_requests),
        max_n=int(args.max_n),
    )


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    jsonlog.setup(args.log_level, args.log_format)
    app = create_app(
        args.backend, api_key=args.api_key, limits=limits_of(args), log_prompts=bool(args.log_prompts)
    )
    # uvicorn re-raises SIGTERM with the previous handler after its graceful shutdown: exit 0 there.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Our handler formats uvicorn's logs too; our own request lines replace its access log.
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, log_config=None, access_log=False
    )


if __name__ == "__main__":
    main()
