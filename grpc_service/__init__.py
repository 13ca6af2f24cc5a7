"""tpuserve.grpc_service."""
