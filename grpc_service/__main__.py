"""`python -m tpuserve.grpc_service --port 50051 [--model PATH]`: flags only, plain-text logs (`tpuserve grpc`
also reads a --config file and logs JSON)."""

import sys

from tpuserve.grpc_service.server import main

sys.exit(main())
