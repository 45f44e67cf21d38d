"""Test-session setup shared by all test modules.

The sequence-parallel (ring) tests need 8 devices. On a CPU-only machine XLA provides them as
host devices, but it reads ``XLA_FLAGS`` once, when jax initializes its backends, so the flag is
set here, before any test module imports jax. A device count already present in ``XLA_FLAGS``
is kept. Single-device tests are unaffected (jit still places work on device 0).
"""

import os

_FLAG = "--xla_force_host_platform_device_count"

if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
