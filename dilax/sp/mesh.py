"""The mesh side of both rings: axis size, mesh/axis checks and the ``shard_map`` around them.

Shared by ``dilated_attention(..., sequence_parallel=)`` and
``block_sparse_attention(..., sequence_parallel=)`` (global view) and their per-device ops (inside
``shard_map``), so that both rings accept the same meshes and fail with the same messages.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def axis_size(axis_name: Hashable, op: str, whole_mesh_op: str) -> int:
    """Size of the bound mesh axis ``axis_name``; a ValueError naming ``op`` (the per-device
    function) and ``whole_mesh_op`` (the op whose ``sequence_parallel=`` runs it over a whole
    mesh) outside a matching shard_map."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not a mesh axis bound here; call {op} inside "
            f"jax.shard_map over a mesh with that axis (or use {whole_mesh_op}(..., "
            f"sequence_parallel=dilax.SequenceParallel(mesh, axis)))"
        ) from e


def check_mesh(mesh, seq_axis, batch_axis) -> None:
    """``mesh`` is a Mesh, ``seq_axis`` (required) and ``batch_axis`` (optional) are distinct
    axes of it."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if seq_axis is None:
        raise ValueError("seq_axis must name a mesh axis, got None")
    for name, ax in (("seq_axis", seq_axis), ("batch_axis", batch_axis)):
        if ax is not None and ax not in mesh.shape:
            raise ValueError(f"{name}={ax!r} is not an axis of the mesh {dict(mesh.shape)}")
    if seq_axis == batch_axis:
        raise ValueError(f"seq_axis and batch_axis must differ, got {seq_axis!r} for both")


def check_sharded_shape(q: jax.Array, mesh: Mesh, seq_axis, batch_axis) -> int:
    """``q: (b, n, ...)`` splits over the mesh: ``n`` by the ``seq_axis`` size ``P`` (returned),
    ``b`` by the ``batch_axis`` size."""
    b, n = q.shape[:2]
    P = mesh.shape[seq_axis]
    if n % P:
        padded = -(-n // P) * P
        raise ValueError(
            f"seq_len n={n} must be divisible by the size {P} of mesh axis {seq_axis!r}: pad "
            f"q, k, v to n={padded} and pass query_seq_lengths=key_value_seq_lengths={n} (the "
            f"padding then gets no weight and its rows output 0; the first {n} rows equal the "
            f"unpadded op)"
        )
    if batch_axis is not None and b % mesh.shape[batch_axis]:
        raise ValueError(
            f"batch size {b} must be divisible by the size {mesh.shape[batch_axis]} of mesh "
            f"axis {batch_axis!r}"
        )
    return P


def shard_sequence(body: Callable, mesh: Mesh, seq_axis, batch_axis, q, k, v,
                   *per_row, per_position: tuple = (), check_vma: bool = True,
                   replicated: tuple = ()) -> jax.Array:
    """``jax.shard_map(body)`` with the batch of ``q, k, v`` and the output over
    ``batch_axis`` and their sequence over ``seq_axis``. ``per_row``: extra ``(b,)`` arrays
    (e.g. valid lengths), sharded over ``batch_axis`` only (``None`` passes through).
    ``per_position``: ``(b, n)`` arrays (e.g. document ids) sharded like ``q``'s first two
    axes, passed to ``body`` right after ``q, k, v``. ``replicated``: pytrees every device
    receives whole (e.g. the arrays score / mask mods close over, sinks), passed last.

    shard_map's default checks (``check_vma=True``): every loop carry and ``cond`` of the core
    and the rings is typed as device-varying. ``check_vma=False`` for bodies that run Pallas
    kernels (their outputs carry no device-varying type).
    """
    spec = PartitionSpec(batch_axis, seq_axis)
    axes = [ax for ax in (seq_axis, batch_axis) if ax is not None]
    if any(mesh.axis_types[mesh.axis_names.index(ax)] == AxisType.Explicit for ax in axes):
        # Explicit mesh axes (jax.make_mesh's default): shard_map wants the inputs' sharding
        # to match in_specs already.
        sharding = NamedSharding(mesh, spec)
        q, k, v = (jax.sharding.reshard(x, sharding) for x in (q, k, v))
        per_position = tuple(jax.sharding.reshard(x, sharding) for x in per_position)
        per_row = tuple(None if x is None else
                        jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(batch_axis)))
                        for x in per_row)
        replicated = jax.tree.map(lambda x: jax.sharding.reshard(
            x, NamedSharding(mesh, PartitionSpec())), replicated)
    row_specs = tuple(None if x is None else PartitionSpec(batch_axis) for x in per_row)
    pos_specs = (spec,) * len(per_position)
    rep_specs = (PartitionSpec(),) * len(replicated)
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(spec, spec, spec, *pos_specs, *row_specs, *rep_specs),
                         out_specs=spec, check_vma=check_vma)(q, k, v, *per_position,
                                                              *per_row, *replicated)
