"""Test-run settings that must be in place before JAX or Triton is imported."""

import os

# Several host devices for the mapping and sharding tests; Triton kernels run in its interpreter.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
