"""The deviceless GPU compile check and the GPU correctness checks.

- :mod:`tools.gpu.compile`: ``python -m tools.gpu`` (also ``python -m benchmarks gpu-compile``,
  ``make gpu-check``): every public op compiled for an H100 and an A100 without a GPU.
- :mod:`tools.gpu.cases`: what it compiles; :mod:`tools.gpu.report`: its resource report;
  :mod:`tools.gpu.hlo`: counts read from compiled HLO.
- :mod:`tools.gpu.check`: every implementation against the reference on the GPU at hand (the
  check section of ``python -m benchmarks gpu``).
"""
