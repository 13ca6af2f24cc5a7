"""tpuserve.sampler."""
