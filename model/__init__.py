"""tpuserve.model."""
