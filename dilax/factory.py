"""``create_attention``: one entry point that picks the attention module and says why.

The PyTorch project's factory picks a class from a string; here the choice also depends on the
backend (Pallas kernels on GPU, the blockwise XLA core elsewhere) and on what the caller gives:
a block pattern means block-sparse, ``sequence_parallel=`` (a mesh with a sequence axis) means
ring attention (dilated, or block-sparse when a pattern is given too).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
from flax import nnx

from dilax import _validation as V
from dilax import registry
from dilax.core import BlockSizes
from dilax.nn.attention import DilatedAttention
from dilax.registry import current_platform
from dilax.sp import SequenceParallel

KINDS = ("auto", "dilated", "block_sparse", "ring")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`create_attention` built, and why."""

    kind: str
    implementation: str
    multihead: bool
    reason: str
    # (branch, implementation, why) per kind of core call, from dilax.registry: e.g.
    # ("dilated branches", "pallas", ...), ("local-window branch", "pallas", ...).
    branches: tuple[tuple[str, str, str], ...] = ()

    def __str__(self) -> str:
        per_branch = "".join(f"; {b}: {impl!r} ({why})" for b, impl, why in self.branches
                             if len(self.branches) > 1)
        return (f"{self.kind} attention ({'multi-head module' if self.multihead else 'module'}),"
                f" implementation={self.implementation!r}: {self.reason}{per_branch}")


class RingDilatedAttention(DilatedAttention):
    """Dilated attention over a device mesh: the sequence axis is sharded on ``seq_axis``.

    Deprecated: this is :class:`dilax.nn.DilatedAttention` with
    ``sequence_parallel=SequenceParallel(mesh, seq_axis, batch_axis)``, the one door (it
    warns, naming it). ``__call__(q, k, v)`` takes global ``(b, n, h, d)`` arrays and
    returns the same as :func:`dilax.dilated_attention` on one device (docs/semantics.md,
    "Ring attention").
    """

    def __init__(self, segment_lengths, dilation_rates, *, mesh: jax.sharding.Mesh,
                 seq_axis: str = "sp", batch_axis: str | None = None, mode: str = "mixture",
                 is_causal: bool = False, scale: float | None = None,
                 block_sizes: BlockSizes | None = None, implementation: str | None = None):
        warnings.warn("dilax.factory.RingDilatedAttention is deprecated: use "
                      "dilax.nn.DilatedAttention(..., sequence_parallel=dilax.SequenceParallel("
                      "mesh, seq_axis))", DeprecationWarning, stacklevel=2)
        super().__init__(segment_lengths, dilation_rates, mode=mode, is_causal=is_causal,
                         scale=scale, block_sizes=block_sizes, implementation=implementation,
                         sequence_parallel=SequenceParallel(mesh, seq_axis, batch_axis))


class Attention(nnx.Module):
    """The module :func:`create_attention` returns: the chosen module plus the reason.

    Call it like the wrapped module; ``.choice`` says what was picked and why.
    """

    def __init__(self, inner: nnx.Module, choice: Choice):
        self.inner = inner
        self.choice = choice

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __repr__(self) -> str:
        return f"dilax.Attention({self.choice}; module={type(self.inner).__name__})"


BACKENDS = ("cpu", "gpu", "cuda", "rocm", "tpu")


def _fail(message: str) -> ValueError:
    valid = ("valid combinations: kind='dilated' with segment_lengths + dilation_rates; "
             "kind='block_sparse' with pattern; kind='ring' with segment_lengths + "
             "dilation_rates (dilated ring) or pattern (block-sparse ring) + "
             "sequence_parallel=dilax.SequenceParallel(mesh, seq_axis); kind='auto' infers "
             "one of these. Add embed_dim + num_heads (+ rngs) for a multi-head module.")
    return ValueError(f"{message}. {valid}")


def create_attention(
    kind: str = "auto",
    *,
    segment_lengths=None,
    dilation_rates=None,
    pattern=None,
    sequence_parallel: SequenceParallel | None = None,
    embed_dim: int | None = None,
    num_heads: int | None = None,
    mode: str = "mixture",
    is_causal: bool = False,
    implementation: str | None = None,
    backend: str | None = None,
    rngs: nnx.Rngs | None = None,
    mesh: jax.sharding.Mesh | None = None,
    seq_axis: str = "sp",
    **module_kwargs: Any,
) -> Attention:
    """Builds the right attention module and reports the choice.

    Args:
      kind: ``"auto"`` (infer), ``"dilated"``, ``"block_sparse"`` or ``"ring"``
        (sequence-parallel: dilated with segment_lengths/dilation_rates, block-sparse with
        a pattern).
      segment_lengths, dilation_rates: dilated/ring configuration.
      pattern: a :class:`dilax.patterns.BlockSparsePattern` (block-sparse, or block-sparse
        ring with ``sequence_parallel``).
      sequence_parallel: a :class:`dilax.SequenceParallel` (mesh, ``seq_axis``, layout):
        ring attention with the sequence sharded over the mesh, as the ops' and the modules'
        ``sequence_parallel=``.
      embed_dim, num_heads: give both for a multi-head module with projections (then
        ``rngs`` is required); otherwise a parameter-free module over ``(b, n, h, d)``.
      mode, is_causal: as in :func:`dilax.dilated_attention`.
      implementation: ``None`` = the best core for ``backend`` per branch
        (:mod:`dilax.registry`: ``"xla"`` off GPU; on GPU ``"pallas"``, ``"xla"`` for the
        rings, or ``"cudnn"`` for a multi-head dilated module
        without a window with a bf16/fp16 ``dtype`` and a head dim cuDNN supports,
        :func:`dilax.registry.gpu_choice`), or one of ``"reference"``, ``"xla"``,
        ``"pallas"``, ``"cudnn"``, which must serve every branch. ``.choice.branches`` lists
        ``(branch, implementation, why)``; when they differ, ``.choice.implementation`` joins
        the names (``"pallas+xla"``) and the module gets ``implementation=None``.
      backend: override the detected backend (``"cpu"``, ``"gpu"``...), e.g. to build a GPU
        configuration on a CPU host.
      mesh, seq_axis: deprecated spelling of ``sequence_parallel=SequenceParallel(mesh,
        seq_axis)`` (warns).
      **module_kwargs: forwarded to the module (``num_kv_heads``, ``dropout``...).

    Returns:
      :class:`Attention`, whose ``.choice`` (and ``repr``) says what was chosen and why.

    Raises:
      ValueError: unknown kind/implementation or an impossible combination, listing the
        valid ones; an explicit ``implementation`` that cannot serve a branch (the reason).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    implementation = registry.check_name(implementation)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None (detect) or one of {BACKENDS}, got {backend!r}")
    mode = V.check_mode_name(mode)
    is_causal = V.check_bool(is_causal, "is_causal")
    if mesh is not None:  # the old spelling of sequence_parallel=
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if sequence_parallel is not None:
            raise TypeError("give the mesh once, as sequence_parallel= (mesh=/seq_axis= are "
                            "its deprecated spelling)")
        warnings.warn("create_attention(mesh=, seq_axis=) is deprecated: pass "
                      "sequence_parallel=dilax.SequenceParallel(mesh, seq_axis)",
                      DeprecationWarning, stacklevel=2)
        sequence_parallel = SequenceParallel(mesh, seq_axis)
    if sequence_parallel is not None and not isinstance(sequence_parallel, SequenceParallel):
        raise TypeError(f"sequence_parallel must be a dilax.SequenceParallel, got "
                        f"{type(sequence_parallel).__name__}")
    backend = current_platform() if backend is None else backend
    dilated_cfg = segment_lengths is not None or dilation_rates is not None
    if dilated_cfg and (segment_lengths is None or dilation_rates is None):
        raise _fail("segment_lengths and dilation_rates must be given together")
    if pattern is not None and dilated_cfg:
        raise _fail("give either pattern (block-sparse) or segment_lengths/dilation_rates "
                    "(dilated), not both")
    multihead = embed_dim is not None or num_heads is not None
    if multihead and (embed_dim is None or num_heads is None or rngs is None):
        raise _fail("a multi-head module needs embed_dim, num_heads and rngs")

    reasons: list[str] = []
    kind = _choose_kind(kind, dilated_cfg, pattern, sequence_parallel, reasons)
    head_dim = embed_dim // num_heads if multihead and embed_dim and num_heads else None
    requests = registry.module_requests(
        kind, block_size=None if pattern is None else pattern.block_size,
        window=module_kwargs.get("local_window") is not None, dtype=module_kwargs.get("dtype"),
        head_dim=head_dim, is_causal=is_causal, platform=backend)
    branches, why = registry.choose_labelled(implementation, requests)
    reasons.append(why)
    names = tuple(dict.fromkeys(name for _, name, _ in branches))
    # one name runs every branch; differing branches run the module's implementation=None,
    # which makes the same per-branch choice (dilax.registry) when it is called
    module_impl = names[0] if len(names) == 1 else None
    if pattern is not None and multihead and implementation is not None:
        auto = registry.choose_labelled(None, requests)[0][0][1]
        if implementation != auto:  # the module has no implementation= option
            raise _fail(f"the multi-head block-sparse module runs implementation=None (here "
                        f"{auto!r}); it cannot run implementation={implementation!r}")
    sp = sequence_parallel if kind == "ring" else None
    inner = _build(kind, multihead, sp, dict(
        embed_dim=embed_dim, num_heads=num_heads, segment_lengths=segment_lengths,
        dilation_rates=dilation_rates, pattern=pattern, mode=mode, is_causal=is_causal,
        implementation=module_impl, rngs=rngs), module_kwargs)
    return Attention(inner, Choice(kind, "+".join(names), multihead, "; ".join(reasons),
                                   branches))


def _choose_kind(kind, dilated_cfg, pattern, sp: SequenceParallel | None, reasons) -> str:
    """Resolves ``"auto"`` (appending why to ``reasons``) and checks the kind's needs."""
    mesh, seq_axis = (None, None) if sp is None else (sp.mesh, sp.seq_axis)
    if kind == "auto":
        if pattern is not None and mesh is not None:
            kind, why = "ring", (f"a block pattern and sequence_parallel were given: "
                                 f"block-sparse ring, the sequence is sharded over mesh axis "
                                 f"'{seq_axis}'")
        elif pattern is not None:
            kind, why = "block_sparse", "a block pattern was given"
        elif dilated_cfg and mesh is not None:
            kind, why = "ring", (f"sequence_parallel was given: the sequence is sharded over "
                                 f"mesh axis '{seq_axis}'")
        elif dilated_cfg:
            kind, why = "dilated", "segment_lengths/dilation_rates were given, no sequence_parallel"
        else:
            raise _fail("create_attention('auto') needs segment_lengths + dilation_rates or a "
                        "pattern")
        reasons.append(why)
    if kind == "dilated" and not dilated_cfg:
        raise _fail("kind='dilated' needs segment_lengths and dilation_rates")
    if kind == "ring" and not dilated_cfg and pattern is None:
        raise _fail("kind='ring' needs segment_lengths and dilation_rates, or a pattern")
    if kind == "block_sparse" and pattern is None:
        raise _fail("kind='block_sparse' needs a pattern")
    if kind == "ring":
        if mesh is None:
            raise _fail("kind='ring' needs sequence_parallel=dilax.SequenceParallel(mesh, "
                        "seq_axis)")
        if seq_axis not in mesh.axis_names:
            raise _fail(f"seq_axis={seq_axis!r} is not an axis of the mesh {mesh.axis_names}")
    if kind != "ring" and mesh is not None:
        raise _fail(f"kind={kind!r} does not take sequence_parallel")
    return kind


def _build(kind: str, multihead: bool, sp: SequenceParallel | None, a: dict,
           module_kwargs: dict) -> nnx.Module:
    """The module of a resolved choice; ``a`` holds the checked arguments."""
    from dilax import nn

    heads = (a["embed_dim"], a["num_heads"])
    if a["pattern"] is not None:  # block-sparse, on one device or as a ring
        if multihead:
            extra = {} if sp is None else dict(sequence_parallel=sp)
            return nn.BlockSparseMultiheadAttention(*heads, a["pattern"], rngs=a["rngs"],
                                                    **extra, **module_kwargs)
        extra = dict(implementation=a["implementation"], sequence_parallel=sp)
        return nn.BlockSparseAttention(a["pattern"], is_causal=a["is_causal"], **extra,
                                       **module_kwargs)
    branches = (a["segment_lengths"], a["dilation_rates"])
    if kind == "dilated":
        if multihead:
            return nn.MultiheadDilatedAttention(
                *heads, *branches, mode=a["mode"], implementation=a["implementation"],
                rngs=a["rngs"], **module_kwargs)
        return nn.DilatedAttention(*branches, mode=a["mode"], is_causal=a["is_causal"],
                                   implementation=a["implementation"], **module_kwargs)
    if multihead:
        return nn.MultiheadDilatedAttention(*heads, *branches, mode=a["mode"], rngs=a["rngs"],
                                            implementation=a["implementation"],
                                            sequence_parallel=sp, **module_kwargs)
    return nn.DilatedAttention(*branches, mode=a["mode"], is_causal=a["is_causal"],
                               implementation=a["implementation"], sequence_parallel=sp,
                               **module_kwargs)
