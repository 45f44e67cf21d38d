"""Shared machinery of the fuzz tests (tests/test_fuzz_*.py, issue #9).

Each generated case is one valid configuration with exactly one thing broken, together with
the argument it breaks. A case passes only if the call raises ``ValueError``/``TypeError``
whose message names that argument; an internal error (XLA, shape, ``AttributeError``...), a
message that does not name the argument, or a silent result is an *unclear* case. Arrays are
``jax.ShapeDtypeStruct`` under ``jax.eval_shape``: every check happens at trace time and
nothing is allocated, which is also how "huge n" must fail (from the shapes alone).

Each test file runs its families with a fixed number of hypothesis examples (derandomized)
through :func:`check_families`, which asserts a minimum number of cases tried and 0 unclear
ones (the three files together: >= 500 cases).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh

HUGE_N = 2**31  # 512 GiB per (1, n, 8, 64) float32 tensor: must fail from the shapes alone


@dataclasses.dataclass
class Case:
    label: str  # entry point / mutation
    fn: Callable[[], Any]
    names: tuple[str, ...]  # the message must name one of these
    exc: type = Exception  # ValueError or TypeError; Exception: either


@dataclasses.dataclass
class Tally:
    tried: Counter = dataclasses.field(default_factory=Counter)
    unclear: list = dataclasses.field(default_factory=list)

    def run(self, case: Case) -> None:
        family = case.label.split(":")[0]
        self.tried[family] += 1
        try:
            case.fn()
        except (ValueError, TypeError) as e:
            msg = str(e)
            if not any(_names(n, msg) for n in case.names):
                self.unclear.append((case.label, f"{type(e).__name__} not naming "
                                     f"{case.names}: {msg[:300]}"))
            elif case.exc is not Exception and not isinstance(e, case.exc):
                self.unclear.append((case.label, f"expected {case.exc.__name__}, got "
                                     f"{type(e).__name__}: {msg[:200]}"))
        except Exception as e:  # noqa: BLE001 - this is what the fuzz looks for
            self.unclear.append((case.label, f"internal {type(e).__name__}: {str(e)[:300]}"))
        else:
            self.unclear.append((case.label, "no error (silent result)"))


def _names(name: str, msg: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", msg) is not None


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _sds(shape, dtype="float32"):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _mesh(p: int = 2) -> Mesh:
    return Mesh(np.array(jax.devices()[:p]), ("sp",), axis_types=(AxisType.Auto,))


def run_family(tally: Tally, make: Callable, examples: int) -> None:
    @settings(max_examples=examples, **SETTINGS)
    @given(st.data())
    def inner(data):
        tally.run(make(data.draw))

    inner()


def check_families(families: list[tuple[str, Callable, int]], min_cases: int, capsys) -> None:
    """Runs every ``(name, make_case, examples)`` family; asserts 0 unclear cases and at
    least ``min_cases`` tried."""
    tally = Tally()
    for _, make, examples in families:
        run_family(tally, make, examples)
    total = sum(tally.tried.values())
    with capsys.disabled():
        print(f"\nfuzz: {total} malformed inputs tried ({dict(tally.tried)}), "
              f"{len(tally.unclear)} unclear")
    problems = "\n".join(f"{label}: {why}" for label, why in sorted(set(tally.unclear))[:40])
    assert not tally.unclear, f"{len(tally.unclear)} unclear cases:\n{problems}"
    assert total >= min_cases
