"""`tpuserve` console script. Subcommands import their layer lazily, so `tpuserve gateway` never loads JAX.

  tpuserve serve     [--port 8000] [--grpc-port 50051] [--model PATH] [--config YAML]   backend + gateway
  tpuserve gateway   --backend HOST:PORT [--backend ...] [--port 8000] [--api-key K]    gateway alone
                     [--config configs/gateway.yaml] [--max-body-bytes] [--max-concurrent-requests] [--max-n]
  tpuserve grpc      [--port 50051] [--model PATH] [--config YAML] [--metrics-port N]   backend alone
  tpuserve generate  [--model PATH] PROMPT                                              one completion, no server
  tpuserve convert   SRC DST                                                            any model -> Orbax
"""

from __future__ import annotations

import sys

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from tpuserve.http_gateway.serve_all import main as run
    elif command == "gateway":
        from tpuserve.http_gateway.serve import main as run
    elif command == "grpc":
        from tpuserve.grpc_service.server import main as run
    elif command == "generate":
        from tpuserve.sampler.generate_cli import main as run
    elif command == "convert":
        from tpuserve.model.convert_cli import main as run
    else:
        print(f"tpuserve: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
