"""tpuserve.proto."""
