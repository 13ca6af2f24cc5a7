"""`tpuserve gateway --backend host:port [--backend ...] [--host H] [--port 8000] [--api-key K]`: run the
OpenAI-compatible gateway with uvicorn. The API key may also come from $TPUSERVE_API_KEY."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn
from tpuserve.http_gateway.app import create_app

API_KEY_ENV = "TPUSERVE_API_KEY"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tpuserve gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="gRPC backend address; repeat for several (round-robin)",
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--log-level", default="info")
    args = list(argv) if argv is not None else None
    if args and args[0] == "gateway":
        args = args[1:]
    return parser.parse_args(args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    app = create_app(args.backend, api_key=args.api_key)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
