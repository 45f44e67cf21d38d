"""The one implementation registry: which attention core serves which request, and why not.

Every op of dilax reduces to core calls of a few kinds (:data:`OPS`): a dilated branch, the
local-window branch, a block-sparse op, a ring hop, a decode step. A :class:`CoreRequest` says
what one such call needs (dtype, head dim, causality, a band or per-key mask, lengths, the
compile platform); :func:`supports` answers, per implementation (``"xla"``, ``"pallas"``,
``"cudnn"``, ``"reference"``), ``None`` (it serves the request) or the reason it does not.
This table is the only place that knows what each core can do:

* an explicit ``implementation=`` that cannot serve a request raises a ``ValueError`` naming
  the reason (:func:`select`) -- no core ever hands its work to another one silently;
* ``implementation=None`` takes the best core that serves each request (:data:`AUTO_ORDER`),
  per branch where the branches of one op differ (:func:`choose_branch_cores`), and says why.
* what ``implementation=`` may name for an op is what its rules serve (:func:`offered`).

An explicit ``"pallas"``/``"cudnn"`` is not checked against the runtime backend: it follows
the *compile target*, refused when the program is lowered for another platform
(:mod:`pallas_kernels.platform`), so a CPU process can compile the GPU kernels for a CUDA
target. ``implementation=None`` follows the runtime backend (``CoreRequest.platform``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TextIO

import jax
import numpy as np

from dilax.core.platform import cuda_plugin_available

IMPLEMENTATIONS = ("reference", "xla", "pallas", "cudnn")
OPS = ("dilated_branch", "window", "block_sparse", "ring_hop", "decode", "dense", "flex")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# implementation=None: the first of these that serves a request. cuDNN only for an
# inference-style forward (create_attention with dtype, head_dim); never the reference.
# dot_product_attention's None is jax's default, the XLA path (dilax's blockwise core); with
# FlexAttention's options (beyond jax) it picks as flex_attention does.
AUTO_ORDER = ("pallas", "xla")
_FLEX_OPS = ("flex", "dense")  # the ops whose Pallas path takes the mods (pallas_kernels.mods)

_WHAT = {"dilated_branch": "a dilated branch", "window": "the local-window branch",
         "block_sparse": "block-sparse attention", "ring_hop": "a ring hop",
         "decode": "a decode step", "dense": "dense attention (dot_product_attention)",
         "flex": "flex_attention (score_mod / mask_mod)"}
_HALF = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class CoreRequest:
    """What one core call needs (static, hashable).

    ``op``: one of :data:`OPS`. ``dtype``: the inputs' dtype (any dtype-like; stored as its
    name), ``None`` when not known yet. ``head_dim``: ``d``, or ``None``. ``has_window``: a band
    mask (``local_window``; implied by ``op="window"``). ``has_key_padding``: a per-key mask
    (``key_padding_mask``). ``has_lengths``: ``query_seq_lengths``/``key_value_seq_lengths``.
    ``platform``: the platform the program is compiled for when known (``"cpu"``, ``"gpu"``...),
    ``None`` when decided at lowering. ``interpret``: the Pallas kernels run in the interpreter.
    ``has_documents``: packed documents (``segment_ids``; per-row key ranges in the core).
    ``block_size``: a block-sparse pattern's block size (with ``op="ring_hop"``: a hop of the
    block-sparse ring), or ``None``.
    ``has_pairwise``: a ``bias`` or ``mask`` operand ``(B, N, T, S)`` (``op="dense"``).
    ``has_score_mod`` (a score_mod or soft-cap), ``has_mask_mod``, ``has_sinks``: FlexAttention
    mods (docs/semantics.md); ``value_head_dim``: ``dv`` when known (``!= head_dim``: dv != d);
    ``mod_problem``: why the mods have no form inside a kernel (:mod:`pallas_kernels.mods`).
    """

    op: str
    dtype: str | None = None
    head_dim: int | None = None
    is_causal: bool = False
    has_window: bool = False
    has_key_padding: bool = False
    has_lengths: bool = False
    platform: str | None = None
    interpret: bool = False
    has_documents: bool = False
    block_size: int | None = None
    has_pairwise: bool = False
    has_score_mod: bool = False
    has_mask_mod: bool = False
    has_sinks: bool = False
    value_head_dim: int | None = None
    mod_problem: str | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"CoreRequest.op must be one of {OPS}, got {self.op!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if self.op == "window":
            object.__setattr__(self, "has_window", True)

    @property
    def what(self) -> str:
        """The request in words (for messages): ``"the local-window branch"``..."""
        return _WHAT[self.op]


# -- what each implementation serves (the one table) ------------------------------------------


def _flex_features(r: CoreRequest, kernel: str, flex: bool = False) -> str | None:
    # flex: the kernel serves the mods (sinks from its lse) of the _FLEX_OPS with a tile form
    mods = not (flex and r.op in _FLEX_OPS)
    what = [w for w, f in (("score_mod / soft-cap", r.has_score_mod and mods), ("mask_mod",
            r.has_mask_mod and mods), ("sinks", r.has_sinks and mods), ("dv != d",
            r.value_head_dim not in (None, r.head_dim)), ("flex_attention",
            r.op == "flex" and not flex)) if f]
    return (f"{kernel}: no {' or '.join(what)} yet (the XLA core serves it)" if what else
            f"{kernel}: {r.mod_problem}" if flex and r.mod_problem else None)


def _reference(r: CoreRequest) -> str | None:
    if r.op == "flex" or r.has_score_mod or r.has_mask_mod or r.has_sinks:
        return "the mask-based reference has no score_mod / mask_mod / sinks"
    if r.op in ("ring_hop", "decode"):
        return (f"the mask-based reference is a whole dense op over (n, n); it has no form "
                f"for {r.what}")
    return None


def _gpu_target(r: CoreRequest) -> str | None:
    if r.platform is None or r.platform in GPU_PLATFORMS or r.interpret:
        return None
    return (f"the Pallas kernels compile for GPU targets, not {r.platform!r}; "
            "interpret=True runs them in the Pallas interpreter")


def _pallas_decode(r: CoreRequest) -> str | None:
    # pallas_kernels.decode: every branch in one split-K kernel, reading cache rows whole
    d = r.head_dim
    if d is not None and (d < 16 or d > 256 or d & (d - 1)):
        return (f"the Pallas decode kernel reads cache rows whole: head_dim must be a power "
                f"of two in [16, 256], got head_dim={d}")
    return _gpu_target(r)


def _pallas(r: CoreRequest) -> str | None:
    if (reason := _flex_features(r, "the Pallas kernels", flex=True)) is not None:
        return reason
    if r.has_documents:
        return "the Pallas kernels have no per-row key ranges (segment_ids, packed documents)"
    # ring_hop: the dilated ring's hops run the flash kernel (traced offsets, key bounds as
    # kv_len); with a block_size, the block-sparse ring's run the block-sparse kernel's rules.
    if r.op == "decode":
        return _pallas_decode(r)
    if r.has_pairwise:
        return "the Pallas flash kernel has no bias or mask operand"
    # the flash kernels take bands, per-key validity, lengths and flex mods (pallas_kernels)
    if (r.op == "block_sparse" or (r.op == "ring_hop" and r.block_size is not None)) and (
            reason := _pallas_block_sparse(r)) is not None:
        return reason
    return _gpu_target(r)


def _pallas_block_sparse(r: CoreRequest) -> str | None:
    """The table-driven block-sparse kernel's own limits (:mod:`pallas_kernels.block_sparse`;
    any ``n``, head dim, GQA, causality and valid lengths are served)."""
    bs = r.block_size
    if bs is not None and bs & (bs - 1):
        return (f"the Pallas block-sparse kernel needs pattern.block_size to be a power of two "
                f"(Triton tiles), got block_size={bs}")
    if bs is not None and bs < 16 and not r.interpret:
        return (f"the Pallas block-sparse kernel needs pattern.block_size >= 16 on GPU (the "
                f"smallest Triton tile; interpret=True runs smaller), got block_size={bs}")
    if r.dtype is not None and r.dtype not in (*_HALF, "float32") and not r.interpret:
        return f"the Pallas block-sparse kernel takes bf16/fp16/fp32 on GPU, got {r.dtype}"
    return None


def _cudnn(r: CoreRequest) -> str | None:
    if (reason := _flex_features(r, "cuDNN's fused attention")) is not None:
        return reason
    if r.has_documents:
        return "cuDNN's fused attention is not wired for segment_ids (packed documents) here"
    if r.op == "block_sparse":
        return "cuDNN has no block-sparse attention"
    if r.op == "ring_hop":
        return "cuDNN's fused attention takes no query/key offsets, which a ring hop needs"
    if r.op == "decode":
        return f"cuDNN's fused attention is not wired for {r.what}; the XLA core serves it"
    if r.has_window:
        return "cuDNN's fused attention has no band mask (local_window)"
    if r.has_key_padding:
        return "cuDNN's fused attention here has no per-key mask (key_padding_mask)"
    if r.dtype is not None and r.dtype not in _HALF:
        return f"cuDNN attention takes bf16/fp16 only, got {r.dtype}"
    if (reason := cudnn_head_dim_problem(r.head_dim, hopper=True)) is not None:
        return reason
    if r.platform is not None and r.platform not in ("gpu", "cuda"):
        return f"cuDNN's fused attention compiles for CUDA GPUs only, not {r.platform!r}"
    return None


def cudnn_head_dim_problem(head_dim: int | None, *, hopper: bool) -> str | None:
    """cuDNN's head-dim rule, the one place it is written: ``% 8 == 0`` and ``<= 128`` on every
    GPU, ``<= 256`` on Hopper (``hopper=True``: what compiles on some GPU)."""
    if head_dim is None or (head_dim % 8 == 0 and head_dim <= (256 if hopper else 128)):
        return None
    return f"cuDNN needs head_dim % 8 == 0 and <= 128 (256 on Hopper), got head_dim={head_dim}"


# the blockwise XLA core serves every request
_RULES = {"reference": _reference, "xla": lambda r: None, "pallas": _pallas, "cudnn": _cudnn}


def supports(implementation: str, request: CoreRequest) -> str | None:
    """``None`` if ``implementation`` serves ``request``, else the reason it does not."""
    if implementation not in _RULES:
        raise ValueError(f"implementation must be one of {(None,) + IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    return _RULES[implementation](request)


def served_by(request: CoreRequest) -> tuple[str, ...]:
    """The implementations that serve ``request`` (in :data:`IMPLEMENTATIONS` order)."""
    return tuple(name for name in IMPLEMENTATIONS if supports(name, request) is None)


def offered(op: str) -> tuple[str, ...]:
    """What ``implementation=`` may name for ``op``: the implementations whose rules serve its
    plain request (no dtype or head dim yet, ``interpret=True``, platform left to lowering),
    e.g. ``offered("block_sparse") == ("reference", "xla", "pallas")`` (the ``_cudnn`` rule
    refuses the op). What depends on the call is checked when it is known (:func:`choose`)."""
    return served_by(CoreRequest(op, interpret=True))


def current_platform() -> str:
    """``jax.default_backend()``: what ``implementation=None`` chooses for."""
    return jax.default_backend()


def check_name(implementation, op: str | None = None) -> str | None:
    """A known implementation name (one that ``op`` offers, :func:`offered`, when given), or
    ``None`` (chosen per request).

    Raises:
      ValueError: ``implementation must be one of (None, ...)`` (the names ``op`` offers), with
        the registry's reason when the name is known but ``op`` refuses it.
    """
    if implementation is None:
        return None
    names = IMPLEMENTATIONS if op is None else offered(op)
    if implementation not in names:
        why = ""
        if op is not None and implementation in IMPLEMENTATIONS:
            request = CoreRequest(op, interpret=True)
            why = f" ({request.what}: {supports(implementation, request)})"
        raise ValueError(f"implementation must be one of {(None,) + names}, "
                         f"got {implementation!r}{why}")
    return implementation


def choose(implementation: str | None, request: CoreRequest) -> tuple[str, str]:
    """``(name, why)``: the implementation that runs ``request``. An explicit name must serve
    it (its compile platform is checked at lowering, so ``request.platform`` is not held
    against it); ``None`` takes the first of :data:`AUTO_ORDER` that serves ``request`` on
    ``request.platform`` (default: the runtime backend).

    Raises:
      ValueError: unknown name, or an explicit one that cannot serve ``request`` (the message
        names the reason and what ``implementation=None`` would run).
    """
    implementation = check_name(implementation)
    if implementation is not None:
        reason = supports(implementation, dataclasses.replace(request, platform=None))
        if reason is not None:
            alt, _ = choose(None, request)
            raise ValueError(f"implementation={implementation!r} cannot run {request.what}: "
                             f"{reason}; use implementation=None to run "
                             f"{'that branch' if 'branch' in request.what else 'it'} on "
                             f"{alt!r}")
        return implementation, f"implementation={implementation!r} requested"
    if request.platform is None:
        request = dataclasses.replace(request, platform=current_platform())
    refused = []
    plain_dense = request.op == "dense" and not (
        request.has_score_mod or request.has_mask_mod or request.has_sinks)
    for name in ("xla",) if plain_dense else AUTO_ORDER:
        reason = supports(name, request)
        if reason is None:
            why = "; ".join([f"platform {request.platform!r}"] + refused)
            return name, f"{request.what} -> {name!r} ({why})"
        refused.append(f"not {name!r}: {reason}")
    raise AssertionError("the XLA core serves every request")  # pragma: no cover


def core(name: str, interpret: bool = False):
    """The :class:`dilax.core.Core` of a chosen name; ``None`` for ``"reference"`` (a whole
    op, not a core)."""
    from dilax.core import core_for  # lazy: the table above needs no core

    return None if name == "reference" else core_for(name, interpret=interpret)


def select(implementation: str | None, request: CoreRequest):
    """The :class:`dilax.core.Core` that runs ``request`` (:func:`choose`), ``None`` for the
    reference. Raises ``ValueError`` like :func:`choose`."""
    return core(choose(implementation, request)[0], request.interpret)


def choose_branch_cores(implementation: str | None, requests: Sequence[CoreRequest]
                        ) -> tuple[tuple, tuple[str, ...]]:
    """One core per branch request, and why: ``(cores, reasons)``.

    An explicit name runs every branch or raises (naming the branch it cannot serve);
    ``None`` picks per branch: each request gets the first core of :data:`AUTO_ORDER` that
    serves it."""
    picked = [choose(implementation, r) for r in requests]
    return (tuple(core(name, r.interpret) for (name, _), r in zip(picked, requests)),
            tuple(why for _, why in picked))


@dataclasses.dataclass(frozen=True)
class Auto:
    """``implementation=None`` as a static value: the cores are chosen per branch when the
    branches are known (:func:`branch_cores`), for ``platform`` (the runtime backend when
    resolved). Hashable, so it can be a jit static argument like a :class:`Core`."""

    interpret: bool = False
    platform: str | None = None
    name = None


def branch_cores(core, plans, *, dtype, head_dim: int, is_causal: bool,
                 key_padding: bool = False, lengths: bool = False,
                 documents: bool = False, **flex) -> tuple:
    """The core of each :class:`~dilax.branch.plan.BranchPlan` of a dilated call.

    ``core``: a :class:`dilax.core.Core` (an explicit implementation: every branch must be
    one it serves, else ``ValueError`` with the reason) or :class:`Auto` (choose per branch).
    A plan with ``window`` set is the local-window branch."""
    interpret = bool(getattr(core, "interpret", False))
    platform = core.platform if isinstance(core, Auto) else None
    requests = [CoreRequest("window" if p.window is not None else "dilated_branch", dtype,
                            head_dim, bool(is_causal), has_key_padding=key_padding,
                            has_lengths=lengths, platform=platform, interpret=interpret,
                            has_documents=documents, **flex)  # flex: CoreRequest fields
                for p in plans]
    if not isinstance(core, Auto):  # explicit: serves every branch or raises
        _ = [choose(core.name, r) for r in requests]
        return (core,) * len(plans)
    return choose_branch_cores(None, requests)[0]


def check_ring_hops(implementation: str | None, interpret: bool = False, dilated: bool = False,
                    block_size: int | None = None) -> None:
    """``implementation`` (and ``interpret``) serve a ring's ``"ring_hop"`` requests
    (``dilated``: the dilated ring's, else the block-sparse ring's, of pattern ``block_size``)
    as far as can be told before the call; else ``ValueError`` naming what serves them."""
    hop = CoreRequest("ring_hop", interpret=bool(interpret),
                      block_size=None if dilated else block_size)
    if implementation is None or (reason := supports(implementation, hop)) is None:
        return
    names = " or ".join(map(repr, served_by(hop)))
    ring = "the dilated ring" if dilated else "the block-sparse ring"
    raise ValueError(f"sequence_parallel runs {ring}'s hops on {names}: implementation "
                     f"must be None or {names}, got {implementation!r} ({reason})")


def resolve(implementation: str | None, *, interpret: bool = False):
    """What a dilated op runs: ``None`` (reference), the explicit name's core, or
    :class:`Auto` for ``implementation=None`` (chosen per branch at trace time)."""
    implementation = check_name(implementation)
    if implementation is None:
        return Auto(bool(interpret), current_platform())
    return core(implementation, interpret)


def table(platform: str | None = None, interpret: bool = False) -> list[tuple[str, str, str]]:
    """``(op, chosen, why)`` for each op's plain request on ``platform`` (default: the
    runtime backend) with ``implementation=None`` (what :func:`dilax.describe` prints)."""
    platform = platform or current_platform()
    return [(op, *choose(None, CoreRequest(op, platform=platform, interpret=interpret)))
            for op in OPS]


# -- what users ask: the default, the GPU choice, describe() ------------------------------

def default_implementation(backend: str | None = None) -> str:
    """What ``implementation=None`` runs for a plain dilated branch on ``backend``
    (:mod:`dilax.registry`): ``"pallas"`` on GPU, ``"xla"`` otherwise."""
    return resolve_implementation(None, backend=backend)


def resolve_implementation(implementation: str | None, *, interpret: bool = False,
                           backend: str | None = None) -> str:
    """Validates ``implementation`` (``ValueError``: unknown name) and resolves ``None`` for a
    plain dilated-branch request on ``backend`` (default: the runtime backend). An explicit
    ``"pallas"``/``"cudnn"`` follows the *compile target* (module docstring); ops whose
    requests differ per branch ask the registry per branch."""
    implementation = check_name(implementation)
    if implementation is not None:
        return implementation
    backend = current_platform() if backend is None else backend
    return choose(None, CoreRequest("dilated_branch", platform=backend, interpret=interpret))[0]


def kernels_available() -> dict[str, str]:
    """What each implementation needs and whether this process can compile or run it."""
    on_gpu, plugin = current_platform() in GPU_PLATFORMS, cuda_plugin_available()
    return {
        "reference": "available (dense mask, small n only)",
        "xla": "available (blockwise core, any backend)",
        "pallas": ("available: Pallas kernels through jax's Triton lowering (forward, dq and "
                   "dk/dv kernels)" if on_gpu else
                   "interpret mode here (interpret=True); compiles for CUDA/ROCm targets "
                   "(jax.jit(...).lower(<arrays on a GPU device>).compile(); "
                   "make gpu-check does it without a GPU)"),
        "cudnn": ("available: cuDNN fused attention forward via jax.nn.dot_product_attention, "
                  "bf16/fp16, XLA-core backward" if on_gpu else
                  "compiles for CUDA targets only" + (
                      " (jax's CUDA plugin is installed)" if plugin else
                      "; needs jax's CUDA plugin (pip install 'jax[cuda12]')")),
    }


def gpu_choice(*, kind: str = "dilated", dtype=None, head_dim: int | None = None,
               window: bool = False) -> tuple[str, str]:
    """The implementation ``"auto"`` picks on a GPU for one request, and why
    (:func:`create_attention <dilax.factory.create_attention>`): the registry's choice, except
    that a bf16/fp16 dilated branch with a head dim cuDNN supports on every GPU (``% 8 == 0``,
    ``<= 128``) takes cuDNN's fused forward when the caller passes ``dtype`` and ``head_dim``
    (inference-style use: only cuDNN's forward runs; its backward is the XLA core)."""
    if kind != "dilated":
        name, why = choose(None, CoreRequest("block_sparse", platform="gpu"))
        return name, f"{kind}: cuDNN has no such attention; {why}"
    request = CoreRequest("window" if window else "dilated_branch", dtype, head_dim,
                          platform="gpu")
    name, why = choose(None, request)
    if dtype is None or head_dim is None:
        return name, f"{why}; pass dtype and head_dim to consider cuDNN"
    reason = supports("cudnn", request) or cudnn_head_dim_problem(head_dim, hopper=False)
    if reason is not None:
        return name, f"{why}; not 'cudnn': {reason}"
    return "cudnn", (f"GPU, {request.dtype}, head_dim={head_dim}: cuDNN's fused forward (its "
                     "backward is the XLA core; use 'pallas' for training)")


def module_requests(kind: str, *, block_size: int | None = None, window: bool = False,
                    **common) -> list[tuple[str, CoreRequest]]:
    """``(label, request)`` for each kind of core call a module makes (``create_attention``):
    ``kind`` ``"dilated"`` (its branches, and the local-window branch with ``window``),
    ``"block_sparse"`` or ``"ring"`` (the hops; block-sparse with a pattern ``block_size``).
    ``common``: the :class:`CoreRequest` fields known when the module is built (``dtype``,
    ``head_dim``, ``is_causal``, ``platform``)."""
    if kind == "ring":
        label = "ring hops" if block_size is None else "block-sparse ring hops"
        return [(label, CoreRequest("ring_hop", **common, block_size=block_size))]
    if kind == "block_sparse":
        return [("block-sparse", CoreRequest("block_sparse", **common, block_size=block_size))]
    return [("dilated branches", CoreRequest("dilated_branch", **common))] + (
        [("local-window branch", CoreRequest("window", **common))] if window else [])


def choose_labelled(implementation: str | None, requests: Sequence[tuple[str, CoreRequest]]
                    ) -> tuple[tuple[tuple[str, str, str], ...], str]:
    """``((label, name, why) per request, reason)``: the cores of a module's labelled requests
    (:func:`module_requests`, all for one ``platform``). An explicit name must serve every
    request (``ValueError`` with the reason, :func:`choose`). ``None`` picks per request; on a
    CUDA GPU a module of one dilated request considers cuDNN (:func:`gpu_choice`)."""
    out = []
    for label, r in requests:
        on_gpu = implementation is None and r.platform in ("gpu", "cuda")
        if on_gpu and len(requests) == 1 and r.op == "dilated_branch":
            name, why = gpu_choice(kind="dilated", dtype=r.dtype, head_dim=r.head_dim)
        else:  # block-sparse (and its ring): the rules for the pattern's block size
            name, why = choose(implementation, r)
            if on_gpu and r.op == "block_sparse":
                why = f"block_sparse: cuDNN has no such attention; {why}"
        out.append((label, name, why))
    platform = requests[0][1].platform
    if implementation is not None:
        return tuple(out), f"implementation {implementation!r} requested"
    if len({name for _, name, _ in out}) == 1:
        return tuple(out), f"backend {platform!r} -> {out[0][1]!r} ({out[0][2]})"
    return tuple(out), f"backend {platform!r}: the core is chosen per branch"


def describe(file: TextIO | None = None) -> None:
    """Prints the backend, devices, available kernels and the core ``implementation=None``
    runs for each op (:mod:`dilax.registry`) (to ``file``, default stdout). Returns ``None``,
    like :func:`help`, so a REPL or notebook shows the text once."""
    from dilax._version import __version__

    lines = [
        f"dilax {__version__}, jax {jax.__version__}",
        f"backend: {current_platform()}  default implementation: {default_implementation()}",
        f"devices ({jax.device_count()}): " + ", ".join(str(d) for d in jax.devices()[:8])
        + (" ..." if jax.device_count() > 8 else ""),
        "kernels:",
    ]
    lines += [f"  {name:10s} {status}" for name, status in kernels_available().items()]
    lines.append("implementation=None runs (dilax.registry):")
    lines += [f"  {op:14s} {name!r}: {why}" for op, name, why in table()]
    print("\n".join(lines), file=file or sys.stdout)
