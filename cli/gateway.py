"""`tpuserve gateway`: the gateway's settings (its defaults, then the `gateway:` section of `--config` or a
flat file of gateway keys, then its flags: http_gateway/settings.py) and its process, with JSON logs."""

from __future__ import annotations

from collections.abc import Sequence

from tpuserve.cli import jsonlog, settings
from tpuserve.http_gateway import settings as gateway
from tpuserve.http_gateway.serve import main as gateway_main
from tpuserve.http_gateway.settings import GatewaySettings


def parse_args(argv: Sequence[str] | None) -> GatewaySettings:
    """The gateway's settings from its command line (a leading "gateway" word is skipped); a file with only
    gateway keys (no sections) is read as the gateway's. A bad setting exits with a usage error naming it."""
    p = gateway.parser(prog="tpuserve gateway")
    settings.add_config_flag(p, "settings file: its gateway: section, or a file of gateway keys (flags win)")
    args = list(argv) if argv is not None else None
    if args and args[0] == "gateway":
        args = args[1:]
    ns = p.parse_args(args)
    try:
        found = settings.load(gateway.defaults(), ns.config, "gateway", vars(ns), flat=True)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if not found.backend:
        p.error("at least one --backend (or `backend:` in --config) is required")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    found = parse_args(argv)
    serve(found)
    return 0


def serve(found: GatewaySettings) -> None:
    """Run the gateway process with `found` settings, logging as they say, until SIGTERM/SIGINT."""
    jsonlog.setup(found.log_level, found.log_format)
    gateway_main(settings=found)
