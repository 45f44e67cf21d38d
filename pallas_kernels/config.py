"""Static launch configuration of the Pallas kernels (block sizes, warps, stages).

A :class:`KernelConfig` is a frozen, hashable dataclass, so it can be a static argument of
``jax.jit`` and a key of the :mod:`pallas_kernels.autotune` cache. :func:`default_config`
gives per-shape defaults; every block size is a power of two, as Triton requires.

The kernels run one Pallas program per ``(query block, batch, head)`` (forward and dq) or per
``(key block, batch, kv head)`` (dk/dv), and loop over the other sequence axis inside the
program, so ``block_*`` sizes are the tile shapes held in registers / shared memory.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

MIN_BLOCK = 16  # smallest tile Triton's tl.dot accepts on each side


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _is_power_of_2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and Triton launch parameters of the flash-attention kernels.

    Attributes:
      block_q, block_k: forward tile (queries per program, keys per loop step).
      block_q_dkv, block_k_dkv: tile of the dk/dv backward kernel (``None``: forward sizes).
      block_q_dq, block_k_dq: tile of the dq backward kernel (``None``: forward sizes).
      num_warps: warps per program (``None``: 4 for head_dim <= 64, else 8).
      num_stages: software-pipelining stages of the key loop (Triton ``num_stages``).

    Block sizes are capped at the (power-of-two rounded) sequence lengths when a kernel is
    launched, so one config can serve several shapes.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int | None = None
    block_k_dkv: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for field in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq",
                      "block_k_dq"):
            value = getattr(self, field)
            if value is None and field not in ("block_q", "block_k"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not _is_power_of_2(value):
                raise ValueError(
                    f"KernelConfig.{field} must be a positive power of two (Triton tiles), "
                    f"got {value!r}"
                )
        if self.num_warps is not None and (
            isinstance(self.num_warps, bool) or not isinstance(self.num_warps, int)
            or not _is_power_of_2(self.num_warps)
        ):
            raise ValueError(
                f"KernelConfig.num_warps must be None or a power of two, got {self.num_warps!r}"
            )
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or (
            self.num_stages < 1
        ):
            raise ValueError(
                f"KernelConfig.num_stages must be a positive int, got {self.num_stages!r}"
            )

    @property
    def dkv_blocks(self) -> tuple[int, int]:
        return (self.block_q_dkv or self.block_q, self.block_k_dkv or self.block_k)

    @property
    def dq_blocks(self) -> tuple[int, int]:
        return (self.block_q_dq or self.block_q, self.block_k_dq or self.block_k)

    def warps(self, head_dim: int) -> int:
        if self.num_warps is not None:
            return self.num_warps
        return 4 if head_dim <= 64 else 8


def default_config(len_q: int, len_k: int, head_dim: int, dtype=jnp.bfloat16, *,
                   masked: bool = False) -> KernelConfig:
    """Per-shape defaults, chosen from what the H100 (sm_90) and A100 (sm_80) compiles report
    (``make gpu-check``, ``benchmarks/results/gpu-compile.md``).

    Forward: 128 x 128 tiles with 8 warps for ``head_dim <= 64`` (jax's reference Triton
    attention uses 128 x 128 with 4 warps, which spills), 128 x 64 with 8 warps up to 128
    (128 x 128 spills on sm_80), 64 x 64 above (register pressure of the
    ``(block_q, head_dim)`` float32 accumulator). Backward: dk/dv 64 x 64 (32 query rows x 64
    keys above head_dim 64: 64 x 64 spills on sm_80) and dq 64 x 32, at least the
    reference's 32 x 32; float32 inputs halve the key tiles (twice the shared
    memory per element); ``masked`` (a band, per-key or query-length mask, whose element masks
    take registers): dk/dv 32 query rows at every head dim (64 x 64 spills on sm_80). No
    register spills in bf16/fp16 for ``head_dim <= 128`` on either target. These are
    compile-checked starting points, not timings: use
    :func:`pallas_kernels.autotune.autotune` on the target device.
    """
    wide = jnp.dtype(dtype).itemsize >= 4
    if head_dim <= 64:
        bq, bk, warps, stages = 128, 128, 8, 3
    elif head_dim <= 128:
        bq, bk, warps, stages = 128, 64, 8, 2
    else:
        bq, bk, warps, stages = 64, 64, None, 2
    if wide:
        bk = max(MIN_BLOCK, bk // 2)
    return KernelConfig(
        block_q=bq, block_k=bk, block_q_dkv=64 if head_dim <= 64 and not masked else 32,
        block_k_dkv=64 if not wide else 32,
        block_q_dq=64, block_k_dq=32, num_warps=warps, num_stages=stages,
    )


def tile(block: int, length: int) -> int:
    """The tile actually launched: ``block`` capped at ``length`` rounded up to a power of two,
    never below :data:`MIN_BLOCK`."""
    return max(MIN_BLOCK, min(block, next_power_of_2(length)))


def triton_compiler_params(config: KernelConfig, head_dim: int, interpret=False):
    """``jax.experimental.pallas.triton.CompilerParams`` for ``config``, which selects the Triton
    lowering of ``pallas_call`` on GPU (jax 0.10: the Triton backend is chosen by the type of
    ``compiler_params``; ``plgpu`` now names Mosaic GPU). Imported lazily; ``None`` when the
    Triton Pallas module is unavailable, and when ``interpret`` (the interpreters need none,
    and the strict one, ``pltpu.InterpretParams``, accepts only Mosaic params)."""
    if interpret:
        return None
    try:
        from jax.experimental.pallas import triton as pltriton
    except ImportError:  # pragma: no cover - depends on the jax build
        return None
    return pltriton.CompilerParams(num_warps=config.warps(head_dim),
                                   num_stages=config.num_stages)
