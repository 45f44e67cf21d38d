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

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "MemoryReport",
    "attention_bytes",
    "available_bytes",
    "check_fits",
    "format_bytes",
    "memory_limit",
    "memory_report",
]

LIMIT_ENV = "DILAX_MEMORY_LIMIT"
_limit_override: list[int | None] = []  # innermost memory_limit() context last


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


# -- fail-fast check ---------------------------------------------------------------------------


def _parse_bytes(value: Any, name: str) -> int:
    """``1024``, ``"1.5GiB"``, ``"512 MiB"``, ``"2e9"`` -> bytes."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        nbytes = int(value)
    else:
        text = str(value).strip()
        units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
                 "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
        num = text.rstrip("bBiIkKmMgGtT ")
        unit = text[len(num):].strip().lower()
        try:
            nbytes = int(float(num) * units[unit])
        except (KeyError, ValueError):
            raise ValueError(f"{name} must be a byte count such as 24GiB, 512MiB or 1e9, "
                             f"got {value!r}") from None
    if nbytes <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return nbytes


def available_bytes() -> int | None:
    """Memory one device may use, for the fail-fast check of :func:`check_fits`.

    In order: the innermost :func:`memory_limit` context, the ``DILAX_MEMORY_LIMIT``
    environment variable (``"24GiB"``, ``"0"``/``"off"`` disables the check), the
    accelerator's ``bytes_limit`` (GPU/TPU), the host's physical memory (CPU). ``None``: unknown
    (no check).
    """
    if _limit_override:
        return _limit_override[-1]
    env = os.environ.get(LIMIT_ENV, "").strip()
    if env:
        if env.lower() in ("0", "off", "none", "inf"):
            return None
        return _parse_bytes(env, LIMIT_ENV)
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


@contextlib.contextmanager
def memory_limit(nbytes: int | str | None) -> Iterator[None]:
    """Temporarily sets the memory :func:`check_fits` compares against (``None``: no check).

    Example::

        with dilax.memory.memory_limit("8GiB"):
            jax.eval_shape(f, q, k, v)  # ValueError if f clearly needs more than 8 GiB
    """
    _limit_override.append(None if nbytes is None else _parse_bytes(nbytes, "nbytes"))
    try:
        yield
    finally:
        _limit_override.pop()


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize


def attention_bytes(q_shape: Sequence[int], kv_shape: Sequence[int], dtype: Any, *,
                    num_branches: int = 1, dense: bool = False) -> int:
    """A lower bound on the bytes one attention call holds at its peak, from shapes alone.

    ``q (b, n, h, d)``, ``k, v (b, n, hk, d)`` and the output ``(b, n, h, d)`` in ``dtype``,
    plus the float32 log-sum-exp of every branch ``(b, n, h)``; with ``dense`` (the mask-based
    reference) also the float32 ``(b, h, n, n)`` logits and probabilities. The blockwise paths
    need somewhat more (block tiles, float32 branch outputs): this is what they *cannot* do
    without, so a call over the bound cannot run.
    """
    b, n, h, _ = (int(s) for s in q_shape)
    total = 2 * _nbytes(q_shape, dtype) + 2 * _nbytes(kv_shape, dtype)
    total += 4 * b * n * h * max(1, int(num_branches))
    if dense:
        total += 2 * 4 * b * h * n * n
    return total


def check_fits(required: int, what: str, hint: str = "") -> None:
    """Raises ``ValueError`` when ``required`` bytes exceed :func:`available_bytes`.

    ``what`` names the call and its offending arguments (the message reads "``what`` would
    need about X GiB, this machine has Y GiB").
    """
    limit = available_bytes()
    if limit is None or required <= limit:
        return
    raise ValueError(
        f"{what} would need about {format_bytes(required)} (at least), this machine has "
        f"{format_bytes(limit)} per device{'; ' + hint if hint else ''}. Set "
        f"{LIMIT_ENV} (e.g. 64GiB, or off) to change the limit"
    )
