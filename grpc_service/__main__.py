"""`python -m tpuserve.grpc_service --port 50051 [--model PATH] [--config configs/X.yaml]`."""

import sys

from tpuserve.grpc_service.server import main

sys.exit(main())
