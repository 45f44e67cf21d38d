"""Orbax checkpoints: save, restore, and the checks that make a resume exact or refuse it.

Layout: ``DIR/<step>/state`` (Orbax arrays: model and optimizer) and ``DIR/<step>/meta`` (JSON:
model and training config, step, and a SHA-256 of the state used to detect corruption).

A save is written to ``DIR/<step>.orbax-checkpoint-tmp-<time>/`` and renamed to ``DIR/<step>``
once complete, so a process killed mid-save (a second Ctrl-C) leaves the earlier checkpoints
untouched and an unfinished directory: :func:`unfinished_saves` finds those, the "no checkpoint"
error names them, and a resume removes them (saying so).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dilax.models import LongNetLM
from dilax.train.config import (
    LEGACY_CHECKPOINT,
    MODEL_FIELDS_ADDED,
    MODEL_FREE_FIELDS,
    MODEL_TRAINING_FIELDS,
    CharTokenizer,
    ModelConfig,
    TrainConfig,
)

CHECKPOINT_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, corrupt, or from another model configuration."""


def state_tree(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, Any]:
    return {"model": nnx.to_pure_dict(nnx.state(model)),
            "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def state_checksum(tree: Any) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _manager(directory: str | Path, keep: int = 3, create: bool = True):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=create),
    )


def save_checkpoint(directory: str | Path, step: int, model: nnx.Module,
                    optimizer: nnx.Optimizer, model_cfg: ModelConfig, train_cfg: TrainConfig,
                    keep: int = 3, extra: dict[str, Any] | None = None) -> Path:
    """Writes ``directory/<step>`` (state + JSON meta) and waits until it is on disk.

    ``extra`` is merged into the meta JSON (the training loop records the data's SHA-256).
    The meta holds a checksum of the whole state and one of the model alone (for
    :func:`load_model`, which reads only the model).
    """
    import orbax.checkpoint as ocp

    tree = state_tree(model, optimizer)
    meta = {
        **(extra or {}),
        "format": CHECKPOINT_FORMAT, "step": int(step), "model_config": model_cfg.to_json(),
        "train_config": dataclasses.asdict(train_cfg), "checksum": state_checksum(tree),
        "model_checksum": state_checksum(tree["model"]),
    }
    mngr = _manager(directory, keep)
    try:
        mngr.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
        mngr.wait_until_finished()
    finally:
        mngr.close()
    return Path(directory).absolute() / str(int(step))


_UNFINISHED = re.compile(r"(\d+)\.orbax-checkpoint-tmp")


def unfinished_saves(directory: str | Path) -> list[Path]:
    """The directories of saves that never completed in ``directory`` (Orbax's
    ``<step>.orbax-checkpoint-tmp-<time>``, left by a process killed while saving), by step."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _UNFINISHED.match(p.name)]
    return sorted(found, key=lambda p: (int(_UNFINISHED.match(p.name)[1]), p.name))


def _unfinished_note(paths: list[Path], what: str) -> str:
    """``"117.orbax-checkpoint-tmp-1/ is an unfinished save (of step 117), <what>"``, joined."""
    return "; ".join(f"{p.name}/ is an unfinished save (of step "
                     f"{_UNFINISHED.match(p.name)[1]}, interrupted before it completed), {what}"
                     for p in paths)


def _existing_steps(directory: str | Path) -> list[int]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def read_checkpoint_meta(directory: str | Path, step: int | None = None) -> tuple[int, dict]:
    """Returns ``(step, meta)`` of the latest (or given) checkpoint in ``directory``."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise CheckpointError(f"no checkpoint found: checkpoint directory {directory} "
                              "does not exist")
    mngr = _manager(directory, create=False)
    try:
        steps = sorted(mngr.all_steps())
        if not steps:
            unfinished = unfinished_saves(directory)
            raise CheckpointError(f"no checkpoint found in {directory}" + (
                f" ({_unfinished_note(unfinished, 'ignored')})" if unfinished else ""))
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {directory} "
                                  f"(available: {steps})")
        try:
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as e:
            raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt or "
                                  f"incomplete: cannot read its meta JSON ({e})") from e
    finally:
        mngr.close()
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {directory / str(step)} has an unknown format "
                              f"(meta: {str(meta)[:200]})")
    return step, meta


def _check_model_config(meta: dict, model_cfg: ModelConfig, where: str | Path,
                        allow_change: bool = False) -> None:
    """Refuses a model config that differs from the checkpoint's in a field that shapes the
    parameters or the computation; ``dropout``/``dtype`` may differ with ``allow_change``
    (``--allow-config-change``), ``remat`` always (it only trades memory for recompute)."""
    saved, now = meta.get("model_config") or {}, model_cfg.to_json()
    if "position_scheme" not in saved:
        raise CheckpointError(f"checkpoint {where}: {LEGACY_CHECKPOINT}")
    saved = {**MODEL_FIELDS_ADDED, **saved}
    ignore = set(MODEL_FREE_FIELDS) | (set(MODEL_TRAINING_FIELDS) if allow_change else set())
    diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k)
                  and k not in ignore)
    if diff:
        hint = ("--dropout and --dtype may change with --allow-config-change. "
                if set(diff) <= set(MODEL_TRAINING_FIELDS) else "")
        raise CheckpointError(
            f"checkpoint {where} was written for a different model config; differing fields: "
            f"{diff} (checkpoint: { {k: saved.get(k) for k in diff} }, now: "
            f"{ {k: now.get(k) for k in diff} }). Use the same model flags or another "
            f"--checkpoint-dir. {hint}".rstrip()
        )


# Fields that fix the run's trajectory: changing one on resume needs --allow-config-change.
# ``steps`` is not one of them: it may grow (train longer) or shrink; the learning-rate
# schedule is then recomputed for the new length, which is logged.
_TRAJECTORY_FIELDS = ("batch_size", "seq_len", "lr", "warmup", "weight_decay", "clip_norm",
                      "seed", "pack", "doc_separator")


def _check_train_config_unchanged(meta: dict, cfg: TrainConfig,
                                  data_sha256: str | None = None) -> dict[str, tuple]:
    """The trajectory fields (and the data) that differ from the checkpoint's,
    ``{name: (checkpoint, now)}``; raises unless ``cfg.allow_config_change``."""
    saved = meta.get("train_config") or {}
    changed = {k: (saved.get(k), getattr(cfg, k)) for k in _TRAJECTORY_FIELDS
               if k in saved and saved[k] != getattr(cfg, k)}
    if data_sha256 and meta.get("data_sha256") and meta["data_sha256"] != data_sha256:
        changed["data"] = (f"{saved.get('data')} (SHA-256 {meta['data_sha256'][:12]}...)",
                           f"{cfg.data} (SHA-256 {data_sha256[:12]}...)")
    if changed and not cfg.allow_config_change:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in changed)
        raise CheckpointError(
            f"checkpoint in {Path(cfg.checkpoint_dir).absolute()} was written with a different "
            f"training config ({flags}; checkpoint vs now: {changed}); resuming would not "
            "reproduce the interrupted run. Use the same flags (or leave them out: --resume "
            "takes them from the checkpoint), or pass --allow-config-change to continue anyway")
    return changed


def _check_steps_left(meta: dict, cfg: TrainConfig) -> None:
    step = int(meta["step"])
    if step >= cfg.steps:
        raise CheckpointError(
            f"the checkpoint in {Path(cfg.checkpoint_dir).absolute()} is at step {step}, and "
            f"--steps is {cfg.steps}: nothing left to train. Pass a larger --steps to train "
            "further, or sample from it with `python -m dilax.sample --checkpoint-dir "
            f"{cfg.checkpoint_dir} --prompt TEXT`")


def restore_checkpoint(directory: str | Path, model: nnx.Module, optimizer: nnx.Optimizer,
                       model_cfg: ModelConfig, step: int | None = None, *,
                       allow_config_change: bool = False) -> tuple[int, dict]:
    """Restores the latest (or given) checkpoint into ``model`` and ``optimizer`` in place.

    Raises:
      CheckpointError: no checkpoint, unreadable or corrupt files (checksum mismatch), or a
        checkpoint written for another model configuration.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    step, meta = read_checkpoint_meta(directory, step)
    _check_model_config(meta, model_cfg, directory / str(step), allow_config_change)
    # Restore to host (NumPy) and put back with jnp.asarray: the arrays are then placed like
    # freshly initialized ones (uncommitted), so an already compiled train step is reused.
    target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state_tree(model, optimizer))
    mngr = _manager(directory, create=False)
    try:
        tree = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state
    except Exception as e:
        raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt or incomplete: "
                              f"cannot read its state ({type(e).__name__}: {e})") from e
    finally:
        mngr.close()
    if state_checksum(tree) != meta.get("checksum"):
        raise CheckpointError(f"checkpoint {directory / str(step)} is corrupt: the state's "
                              "SHA-256 does not match the one recorded when it was saved")
    for obj, key in ((model, "model"), (optimizer, "optimizer")):
        state = nnx.state(obj)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, tree[key]))
        nnx.update(obj, state)
    return step, meta


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """What :func:`load_model` returns: the model, its tokenizer and configs, and where from."""

    model: LongNetLM
    tokenizer: CharTokenizer
    model_config: ModelConfig
    train_config: TrainConfig
    step: int
    path: Path


def load_model(directory: str | Path, step: int | None = None) -> LoadedModel:
    """Restores only the model of the latest (or given) checkpoint: no optimizer is built and
    the optimizer state is not read. The model config and the tokenizer (the vocabulary) come
    from the checkpoint's meta.

    Example::

        m = load_model("checkpoints/run")
        print(sample_text(m, "Once upon a time", 200, temperature=0.8, top_k=20, seed=0))

    Raises:
      CheckpointError: no checkpoint, unreadable files, or a model whose bytes do not match
        the checksum recorded when it was saved.
    """
    import orbax.checkpoint as ocp

    from dilax.train.steps import make_model

    directory = Path(directory).absolute()
    step, meta = read_checkpoint_meta(directory, step)
    where = directory / str(step)
    if "position_scheme" not in meta["model_config"]:
        raise CheckpointError(f"checkpoint {where}: {LEGACY_CHECKPOINT}")
    model_cfg = ModelConfig.from_json(meta["model_config"])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make_model(model_cfg, 0)))
    target = {"model": jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                    nnx.to_pure_dict(abstract))}
    try:
        tree = ocp.PyTreeCheckpointer().restore(where / "state", args=ocp.args.PyTreeRestore(
            target, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                              target),
            partial_restore=True))["model"]
    except Exception as e:
        raise CheckpointError(f"checkpoint {where} is corrupt or incomplete: cannot read its "
                              f"model ({type(e).__name__}: {e})") from e
    # checkpoints written before the model had its own checksum are read unverified
    if "model_checksum" in meta and state_checksum(tree) != meta["model_checksum"]:
        raise CheckpointError(f"checkpoint {where} is corrupt: the model's SHA-256 does not "
                              "match the one recorded when it was saved")
    nnx.replace_by_pure_dict(abstract, jax.tree.map(jnp.asarray, tree))
    return LoadedModel(nnx.merge(graphdef, abstract), CharTokenizer(model_cfg.vocab), model_cfg,
                       TrainConfig.from_json(meta.get("train_config") or {}), step, where)


def check_before_run(cfg: TrainConfig, model_cfg: ModelConfig,
                     data_sha256: str | None = None) -> None:
    """Fails fast, before anything is built or trained.

    With ``cfg.resume``: the latest checkpoint must be readable, written for ``model_cfg`` and
    (unless ``cfg.allow_config_change``) the same training trajectory and data
    (``data_sha256``), and before ``cfg.steps``. Without: a
    ``cfg.checkpoint_dir`` must not already hold checkpoints (that run would be overwritten).

    Raises:
      CheckpointError: saying which, and what to do.
    """
    if cfg.resume:
        _, meta = read_checkpoint_meta(cfg.checkpoint_dir)
        _check_model_config(meta, model_cfg, cfg.checkpoint_dir, cfg.allow_config_change)
        _check_train_config_unchanged(meta, cfg, data_sha256)
        _check_steps_left(meta, cfg)
    elif cfg.checkpoint_dir:
        existing = _existing_steps(cfg.checkpoint_dir)
        if existing:
            raise CheckpointError(
                f"{Path(cfg.checkpoint_dir).absolute()} already holds checkpoints (steps "
                f"{existing}); pass --resume to continue that run or use another "
                "--checkpoint-dir")


def resume(cfg: TrainConfig, model: nnx.Module, optimizer: nnx.Optimizer,
           model_cfg: ModelConfig, log: Callable[[str], None],
           data_sha256: str | None = None) -> int:
    """Restores the latest checkpoint of ``cfg.checkpoint_dir`` into ``model`` and
    ``optimizer``; returns its step. Logs a warning when the training flags differ from the
    checkpoint's (allowed by ``cfg.allow_config_change``)."""
    unfinished = unfinished_saves(cfg.checkpoint_dir)
    start, meta = restore_checkpoint(cfg.checkpoint_dir, model, optimizer, model_cfg,
                                     allow_config_change=cfg.allow_config_change)
    if int(optimizer.step[...]) != start:
        raise CheckpointError(f"checkpoint step {start} disagrees with the optimizer step "
                              f"{int(optimizer.step[...])} stored in it")
    changed = _check_train_config_unchanged(meta, cfg, data_sha256)
    if changed:
        log(f"warning: training config differs from the checkpoint's {changed}; the run "
            "will not reproduce an uninterrupted one")
    saved_steps = (meta.get("train_config") or {}).get("steps")
    if saved_steps is not None and saved_steps != cfg.steps:
        log(f"note: --steps {cfg.steps} (the checkpoint's run had {saved_steps}): the "
            f"learning-rate schedule now decays over {cfg.steps} steps")
    for p in unfinished:  # restored fine from a complete one: the unfinished ones are junk
        shutil.rmtree(p, ignore_errors=True)
    found = f"complete checkpoints: steps {_existing_steps(cfg.checkpoint_dir)}"
    if unfinished:
        found += "; " + _unfinished_note(unfinished, "removed")
    log(f"{found}; resumed from {Path(cfg.checkpoint_dir).absolute() / str(start)} "
        f"(step {start})")
    return start
