"""Test-session setup shared by all test modules: ``XLA_FLAGS``, set before any test module
imports jax (XLA reads them once, when jax initializes its backends).

- Devices: the sequence-parallel (ring) tests need 8 devices. On a CPU-only machine XLA
  provides them as host devices. Single-device tests are unaffected (jit still places work on
  device 0).
- Compile speed: the suite compiles far more than it runs (hundreds of small programs, the
  Pallas interpreter's especially), so XLA:CPU compiles at LLVM -O0 with the legacy elemental
  fusion emitters. On the dilated-attention programs that is ~5x less compile time than the
  default pipeline, for kernels that are slower but run on tiny shapes. HLO passes (fusion
  decisions, buffer assignment, so ``memory_analysis``) are unchanged; numerics change at the
  rounding level only, which the tolerances (``tests/tolerance.py``) allow for anyway, as they
  must for other CPUs. ``DILAX_TEST_FULL_OPT=1`` keeps XLA's default pipeline.

A flag already present in ``XLA_FLAGS`` is kept as the user set it. Subprocesses started by the
tests inherit the environment; those that need another device count use :func:`xla_flags`.
"""

import os
import re

_DEVICE_COUNT = "--xla_force_host_platform_device_count"
# These flags exist in the XLA of jaxlib 0.10.2 and 0.11.2 (their names are in both wheels'
# libjax_common.so); XLA aborts on unknown flags, so check them when moving the jax pin.
_COMPILE_SPEED_FLAGS = {
    "--xla_backend_optimization_level": "0",
    "--xla_llvm_disable_expensive_passes": "true",
    "--xla_cpu_use_fusion_emitters": "false",
}


def xla_flags(device_count: int = 8, base: str | None = None, fast_compile: bool = True) -> str:
    """``base`` (default: the current ``XLA_FLAGS``) with this session's flags added where
    ``base`` does not set them, and the host device count set to ``device_count``.
    ``fast_compile=False`` drops the compile-speed flags (for work that runs more than it
    compiles)."""
    flags = os.environ.get("XLA_FLAGS", "") if base is None else base
    flags = re.sub(rf"{_DEVICE_COUNT}=\S*", "", flags)
    wanted = {_DEVICE_COUNT: str(device_count)}
    if not fast_compile:
        for name in _COMPILE_SPEED_FLAGS:
            flags = re.sub(rf"{name}=\S*", "", flags)
    elif os.environ.get("DILAX_TEST_FULL_OPT", "") in ("", "0"):
        wanted.update(_COMPILE_SPEED_FLAGS)
    added = [f"{name}={value}" for name, value in wanted.items()
             if name == _DEVICE_COUNT or f"{name}=" not in flags]
    return " ".join([*flags.split(), *added])


if _DEVICE_COUNT in os.environ.get("XLA_FLAGS", ""):  # a device count the user set is kept
    _count = int(re.search(rf"{_DEVICE_COUNT}=(\d+)", os.environ["XLA_FLAGS"]).group(1))
else:
    _count = 8
os.environ["XLA_FLAGS"] = xla_flags(_count)

# One persistent compilation cache for the session (a fresh temporary directory, removed at
# the end): the suite's subprocesses (training CLIs stopped and resumed, README blocks,
# notebook kernels) and its two xdist workers compile many identical programs, which
# then compile once (~5 % of the suite's CPU time). The controller creates it before the
# workers start; they inherit it through the environment. A cache directory the user set is
# kept, with their thresholds.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dilax-test-jax-cache-")
    os.environ["DILAX_TEST_OWNS_JAX_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_unconfigure(config):
    owned = os.environ.get("DILAX_TEST_OWNS_JAX_CACHE")
    if owned and not hasattr(config, "workerinput"):  # the controller (or a run without -n)
        import shutil

        shutil.rmtree(owned, ignore_errors=True)

# Test modules by cost, largest first: seconds per module (call + setup) measured in a `make
# test` run with --durations=0 (2026-11-28, after this round's new modules; re-sorted at the end
# of the FlexAttention round). `make test` runs
# `--dist loadfile --no-loadscope-reorder`, so whole modules go to the two workers in this
# order; longest first keeps their finishing times close, and the cheap modules at the end
# fill the gaps (a costly module left out of this list would start last and keep one worker
# busy alone: add new modules by their cost). Modules not listed (each under ~2 s) follow in
# their usual order.
_COSTLIEST_MODULES = (
    "test_dilated.py", "test_ring.py", "test_notebooks.py", "test_pallas.py",
    "test_flex_ring.py", "test_readme.py", "test_strict_modes.py", "test_ring_documents.py",
    "test_block_sparse.py", "test_flex_dilated.py", "test_documents.py", "test_quality.py",
    "test_numerics.py", "test_lengths.py", "test_nn.py", "test_request.py",
    "test_ring_pallas.py", "test_train_cli.py", "test_sequence_parallel.py",
    "test_ring_lengths.py", "test_models.py", "test_positions.py", "test_decode.py",
    "test_train.py", "test_dot_product.py", "test_pallas_masks.py", "test_flex_ops.py",
    "test_registry.py", "test_flex.py", "test_attention_fn_flax.py",
    "test_block_sparse_ring.py", "test_train_interrupts.py", "test_block_sparse_ring_pallas.py",
    "test_pallas_dense_mods.py", "test_train_resume.py", "test_pallas_mods.py",
    "test_ring_plan.py", "test_ring_multiprocess.py", "test_flex_bench.py",
    "test_batch_dims.py", "test_train_packed.py", "test_flex_decode.py", "test_empty_batch.py",
    "test_imports.py", "test_packed_lm.py", "test_nan_inputs.py", "test_lazy_subpackages.py",
    "test_decode_pallas.py", "test_fuzz_sparse.py", "test_token_ids.py",
    "test_benchmarks_gpu.py", "test_block_sparse_lengths.py", "test_decode_overflow.py",
    "test_fuzz_dilated.py", "test_factory.py", "test_migration.py", "test_dilated_memory.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_COSTLIEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a module


# `--jax-strict=rank,x64,nans` (any subset) runs the selected tests under jax's strict modes:
# `jax_numpy_rank_promotion="raise"`, `jax_enable_x64=True`, `jax_debug_nans=True`. The core
# cases run under all three in every `make test` (tests/test_strict_modes.py); the option is
# for running other modules that way too.
_STRICT_FLAGS = {"rank": ("jax_numpy_rank_promotion", "raise"), "x64": ("jax_enable_x64", True),
                 "nans": ("jax_debug_nans", True)}


def pytest_addoption(parser):
    parser.addoption("--jax-strict", default="", metavar="MODES",
                     help="comma-separated strict JAX modes for the whole session: "
                          + ", ".join(_STRICT_FLAGS))


def pytest_configure(config):
    modes = [m for m in config.getoption("--jax-strict").split(",") if m]
    unknown = sorted(set(modes) - set(_STRICT_FLAGS))
    if unknown:
        raise ValueError(f"--jax-strict: unknown mode(s) {unknown}; valid: {list(_STRICT_FLAGS)}")
    if modes:
        import jax

        for mode in modes:
            jax.config.update(*_STRICT_FLAGS[mode])
