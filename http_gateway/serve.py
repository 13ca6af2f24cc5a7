"""The gateway process (`tpuserve gateway`, see settings.py for its flags and YAML keys): the OpenAI-compatible
app served by uvicorn until SIGTERM/SIGINT. The command line (cli/gateway.py) reads the settings file and
sets up the JSON logs before it calls `main`; run on its own (`python -m tpuserve.http_gateway.serve`), the
gateway takes its flags only and logs plain text.

Threads of the process, and what each owns:
  main thread   uvicorn's asyncio event loop, which runs everything of ours: HTTP connections, routes and
                middleware (auth, limits, metrics, request log lines), SSE streams, and the grpc.aio channels
                to the backends (calls, health checks, model discovery)
gRPC's C core also runs its own polling threads; no Python code of ours runs on them. The gateway starts no
thread of its own (its /metrics are served by the app).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence

import uvicorn
from tpuserve.http_gateway.app import create_app
from tpuserve.http_gateway.settings import GatewaySettings, parse_args


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None, settings: GatewaySettings | None = None) -> None:
    """Serve with `settings` (finished: `tpuserve gateway` passes them), else with the flags in `argv` on the
    defaults and plain-text logs."""
    if settings is None:
        settings = parse_args(argv)
        logging.basicConfig(
            level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    run(settings)


def run(settings: GatewaySettings) -> None:
    """Serve until SIGTERM/SIGINT with `settings`, logging through the root logger as it is set up."""
    app = create_app(
        list(settings.backend),
        api_key=settings.api_key,
        admin_key=settings.admin_key,
        limits=settings.limits(),
        log_prompts=settings.log_prompts,
        cors_allow_origins=list(settings.cors_allow_origins),
        backend_tls=settings.backend_tls_config(),
    )
    # uvicorn re-raises SIGTERM with the previous handler after its graceful shutdown: exit 0 there.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Our handler formats uvicorn's logs too; our own request lines replace its access log.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
    )


if __name__ == "__main__":
    main()
