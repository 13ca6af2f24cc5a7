"""tpuserve.http_gateway."""
