"""`tpuserve` console script: one command per layer's process, each with its own `main(argv)`.

tpuserve serve     [--port 8000] [--grpc-port 50051] [--model PATH] [--config YAML]   backend + gateway
tpuserve gateway   --backend HOST:PORT [--backend ...] [--port 8000] [--api-key K]    gateway alone
                   [--config configs/gateway.yaml] [--max-body-bytes] [--max-concurrent-requests] [--max-n]
tpuserve grpc      [--port 50051] [--model PATH] [--config YAML] [--metrics-port N]   backend alone
                   [--coordinator H:P --num-processes N --process-id I]            one model over N processes
tpuserve generate  [--model PATH] PROMPT                                              one completion, no server
tpuserve convert   SRC DST                                                            any model -> Orbax
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

USAGE = __doc__

# Only the chosen command's module is imported: `tpuserve gateway` and the gateway process of `tpuserve serve`
# load no JAX, and every command starts without loading the others. `gateway` and `grpc` read the settings
# file and set up the JSON logs here (gateway.py, backend.py), then call their layer's main.
COMMANDS = {
    "serve": "tpuserve.cli.serve",
    "gateway": "tpuserve.cli.gateway",
    "grpc": "tpuserve.cli.backend",
    "generate": "tpuserve.sampler.generate_cli",
    "convert": "tpuserve.model.convert_cli",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tpuserve: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest) or 0
