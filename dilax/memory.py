"""Memory accounting: what XLA will allocate for a function, before running it.

The PyTorch world's "memory pools" are XLA's job in JAX. What a user controls is:

* **blockwise computation** — every dilax op is blockwise, nothing ``n x n`` is materialized;
* **buffer donation** — in a training step, donate the parameters and optimizer state so XLA
  updates them in place instead of holding two copies::

      @functools.partial(jax.jit, donate_argnums=(0, 1))
      def train_step(params, opt_state, batch):
          grads = jax.grad(loss_fn)(params, batch)
          updates, opt_state = optimizer.update(grads, opt_state, params)
          return optax.apply_updates(params, updates), opt_state

  (with Flax NNX: ``nnx.jit(train_step, donate_argnums=(0, 1))`` on the model and optimizer);
* **rematerialization** — ``jax.checkpoint`` / ``nnx.remat`` around each layer trades FLOPs for
  activation memory.

:func:`memory_report` reads XLA's own compile-time buffer assignment, so it is exact for the
compiled program and costs a compilation, not a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["MemoryReport", "memory_report", "format_bytes"]


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes XLA assigns to one compiled program (per device), from ``memory_analysis()``.

    Attributes:
      temp_bytes: scratch buffers live during the program (intermediates).
      argument_bytes: the inputs' buffers.
      output_bytes: the outputs' buffers.
      alias_bytes: output bytes that reuse (donated) input buffers.
      generated_code_bytes: size of the compiled code (0 where the backend does not say).
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int

    @property
    def peak_bytes(self) -> int:
        """``temp + argument + output - alias``: live bytes at the program's peak, upper bound."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

    def __str__(self) -> str:
        return (
            f"peak {format_bytes(self.peak_bytes)} (temp {format_bytes(self.temp_bytes)}, "
            f"arguments {format_bytes(self.argument_bytes)}, outputs "
            f"{format_bytes(self.output_bytes)}, aliased {format_bytes(self.alias_bytes)})"
        )


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``1536 -> '1.50 KiB'``, ``512 -> '512 B'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_report(
    fn: Callable[..., Any],
    *args: Any,
    static_argnames: tuple[str, ...] = (),
    donate_argnums: tuple[int, ...] = (),
    **kwargs: Any,
) -> MemoryReport:
    """Compiles ``fn(*args, **kwargs)`` and returns XLA's memory analysis.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` (nothing is allocated for those).
    Keyword arguments named in ``static_argnames`` are treated as static. A function that is
    already jitted is compiled as is (and a later call of it reuses this compilation). For a
    function sharded over several devices the numbers are those of one device's program.

    Returns:
      :class:`MemoryReport` in bytes; ``peak_bytes`` is the usual figure.

    Raises:
      RuntimeError: the backend provides no ``memory_analysis()``.
      Whatever ``fn`` raises while tracing (e.g. dilax's ``ValueError`` for bad shapes).

    Example::

        rep = dilax.memory.memory_report(
            lambda q, k, v: dilax.dilated_attention(q, k, v, (2048,), (1,)),
            jax.ShapeDtypeStruct((1, 65536, 8, 64), jnp.float32), *[kv] * 2)
        print(rep)  # peak ... (temp ..., arguments ..., outputs ...)
    """
    if hasattr(fn, "lower"):
        jitted = fn
    else:
        jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnums=donate_argnums)
    compiled = jitted.lower(*args, **kwargs).compile()
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not report
        raise RuntimeError("this backend does not provide memory_analysis()")
    return MemoryReport(
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(getattr(stats, "generated_code_size_in_bytes", 0)),
    )
