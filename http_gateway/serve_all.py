"""`tpuserve serve` (what `make serve` runs): one gRPC backend process on GRPC_PORT and the gateway on PORT.

The backend is a child process (it owns JAX and the devices; the gateway process never imports JAX). The gateway's
/health answers 503 until the backend's gRPC health says SERVING (after warm-up). SIGTERM/SIGINT stops the
gateway, then the backend drains its in-flight requests and exits.

`--config FILE` goes to both processes: the backend reads its `engine:` and `server:` sections, the gateway its
`gateway:` section. Flags this command does not know are the gateway's (`tpuserve gateway --help`): limits,
CORS, HTTPS, request timeout."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys


def _die_with_parent() -> None:
    """In the backend child: receive SIGTERM if this process dies without stopping it (Linux prctl)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tpuserve serve",
        description=__doc__.split("\n\n")[0],
        epilog="Other flags are passed to the gateway; see `tpuserve gateway --help`.",
    )
    p.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
    p.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 50051)))
    p.add_argument("--model", default=None, help="GGUF file, HF directory or Orbax checkpoint (default: embedded)")
    p.add_argument(
        "--config", default=None, help="YAML config (configs/*.yaml): engine:/server: sections, gateway: section"
    )
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (or $TPUSERVE_API_KEY)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ["METRICS_PORT"]) if os.environ.get("METRICS_PORT") else None,
        help="backend Prometheus metrics HTTP port (default: GRPC_PORT + 1; 0 = off); the gateway's are at /metrics",
    )
    p.add_argument("--log-prompts", action="store_true", help="include prompts in both processes' request logs")
    args, gateway_extra = p.parse_known_args(argv)
    metrics_port = args.grpc_port + 1 if args.metrics_port is None else args.metrics_port

    backend_cmd = [sys.executable, "-m", "tpuserve.grpc_service", "--host", "127.0.0.1", "--port", str(args.grpc_port)]
    if args.model:
        backend_cmd += ["--model", args.model]
    if args.config:
        backend_cmd += ["--config", args.config]
    backend_cmd += ["--metrics-port", str(metrics_port)]  # on 127.0.0.1, like the backend's gRPC port
    if args.log_prompts:
        backend_cmd += ["--log-prompts"]
    backend = subprocess.Popen(backend_cmd, preexec_fn=_die_with_parent)
    gateway_argv = ["--backend", f"127.0.0.1:{args.grpc_port}", "--host", args.host, "--port", str(args.port)]
    if args.api_key:
        gateway_argv += ["--api-key", args.api_key]
    if args.log_prompts:
        gateway_argv += ["--log-prompts"]
    if args.config:
        gateway_argv += ["--config", args.config]
    gateway_argv += gateway_extra
    from tpuserve.http_gateway.serve import main as gateway_main

    try:
        # uvicorn shuts down gracefully on SIGTERM/SIGINT; gateway_main then exits by SystemExit (its handler for
        # the re-raised signal), so `finally` stops the backend. Should this process die first, the backend gets
        # SIGTERM from the kernel (_die_with_parent).
        gateway_main(gateway_argv)
    finally:
        if backend.poll() is None:
            backend.send_signal(signal.SIGTERM)
            try:
                backend.wait(60)
            except subprocess.TimeoutExpired:
                backend.kill()
    return 0
