"""docs/migration.md's side-by-side program runs as written, and the differences it quotes hold.

The guide's runnable blocks carry a marker on the line above them,
``<!-- migration: NAME -->`` (``inputs``, ``dilax``, ``torch``, ``compare``, ``port``); this
module runs them in that order in one namespace, as a reader would paste them. The dilax side
always runs (and is checked against dilax's own explicit-mask reference); the PyTorch side needs
torch and is skipped without it. It runs our PyTorch re-implementations of
dilated-attention-pytorch (``benchmarks/torch_ref.py``: the released 0.2.0, and the package
after the fork commit that removed the per-group ``x / x.sum(dim=(1, 2))``), not the package
itself, which 0.2.0 ties to xformers.

Every number below is quoted in the guide (checked here too), measured on CPU, float32.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "migration.md"
MARKER = re.compile(r"<!--\s*migration:\s*([a-z]+)\s*-->")

# The guide's program: (2, 512, 6, 32) float32 from numpy default_rng(0), segment lengths
# (128, 256, 512), rates (1, 2, 4), causal (6 heads: three equal groups).
GUIDE_GROUPED_VS_V020 = 6.2608  # max |dilax grouped - released 0.2.0|
GUIDE_MIXTURE_VS_GROUPED = 3.0028  # max |dilax mixture - dilax grouped|
GUIDE_NOT_CAUSAL = (4.9401, 0.8389)  # the same two without is_causal
# The README quick start's tensors (q (1, 2048, 8, 64), k = v (1, 2048, 2, 64) repeated to 8
# heads for torch; (512, 1024, 2048), (1, 2, 4)); 8 heads in 3 groups of 3, 3, 2.
QUICK_START = {  # is_causal: (vs 0.2.0, vs 0.2.0 without the x.sum line, mixture vs grouped)
    True: (26.2339, 0.7529, 2.9139),
    False: (2.8637, 0.2307, 0.8625),
}
AGREE = 1e-5  # grouped vs the fixed package, and vs dilax's reference
REL = 1e-3  # a quoted difference, relative (float32 rounding differs between CPUs)


def guide_blocks(text: str) -> dict[str, str]:
    """``{name: code}`` of the python blocks that follow a ``migration:`` marker."""
    lines, blocks = text.splitlines(), {}
    for i, line in enumerate(lines):
        m = MARKER.fullmatch(line.strip())
        if not m:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        assert j < len(lines) and lines[j].strip() == "```python", (
            f"docs/migration.md line {i + 1}: a migration marker must precede a python block")
        end = lines.index("```", j + 1)
        assert m.group(1) not in blocks, f"two blocks named {m.group(1)!r}"
        blocks[m.group(1)] = "\n".join(lines[j + 1:end]) + "\n"
    return blocks


TEXT = GUIDE.read_text()
BLOCKS = guide_blocks(TEXT)


def run(*names: str) -> dict:
    namespace: dict = {"__name__": "migration_guide"}
    for name in names:
        exec(compile(BLOCKS[name], f"docs/migration.md[{name}]", "exec"), namespace)
    return namespace


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def test_guide_has_the_program_and_quotes_the_tested_numbers():
    assert set(BLOCKS) == {"inputs", "dilax", "torch", "compare", "port"}
    for value in (GUIDE_GROUPED_VS_V020, GUIDE_MIXTURE_VS_GROUPED, *GUIDE_NOT_CAUSAL,
                  *(x for row in QUICK_START.values() for x in row)):
        assert f"{value:.4f}"[:-1] in TEXT, value  # quoted to (at least) 3 decimals


def test_dilax_side_matches_its_reference():
    import dilax

    ns = run("inputs", "dilax")
    q, k, v = ns["q"], ns["k"], ns["v"]
    ws, rs = ns["segment_lengths"], ns["dilation_rates"]
    for mode in ("grouped", "mixture"):
        ref = dilax.dilated_attention(q, k, v, ws, rs, is_causal=True, mode=mode,
                                      implementation="reference")
        assert max_abs(ns[mode], ref) <= AGREE, mode
    assert max_abs(ns["module_out"], ns["grouped"]) <= AGREE
    assert ns["mixture_vs_grouped"] == pytest.approx(GUIDE_MIXTURE_VS_GROUPED, rel=REL)


def test_torch_side_matches_the_quoted_differences():
    pytest.importorskip("torch", reason="torch is not installed: the PyTorch side of "
                        "docs/migration.md is skipped (pip install torch to run it)")
    ns = run("inputs", "dilax", "torch", "compare", "port")
    d = ns["differences"]
    assert d["grouped vs package after the fix"] <= AGREE
    assert d["grouped vs 0.2.0"] == pytest.approx(GUIDE_GROUPED_VS_V020, rel=REL)
    assert d["0.2.0 without the x.sum line vs after the fix"] <= 1e-6
    assert d["mixture vs grouped"] == pytest.approx(GUIDE_MIXTURE_VS_GROUPED, rel=REL)
    assert d["multi-head, ported weights"] <= AGREE


@pytest.mark.parametrize("is_causal", [True, False])
def test_quick_start_tensors(is_causal):
    torch = pytest.importorskip("torch", reason="torch is not installed: the quick-start "
                                "comparison with the PyTorch package is skipped")
    import jax

    import dilax
    from benchmarks.torch_ref import (
        dilated_attention_grouped_torch,
        dilated_attention_v020_torch,
    )

    q = jax.random.normal(jax.random.PRNGKey(0), (1, 2048, 8, 64))
    k = v = jax.random.normal(jax.random.PRNGKey(1), (1, 2048, 2, 64))
    ws, rs = (512, 1024, 2048), (1, 2, 4)
    tq, tk, tv = (torch.from_numpy(np.repeat(np.asarray(x), 8 // x.shape[2], axis=2))
                  for x in (q, k, v))
    fixed = dilated_attention_grouped_torch(tq, tk, tv, ws, rs, is_causal).numpy()
    v020 = dilated_attention_v020_torch(tq, tk, tv, ws, rs, is_causal).numpy()
    no_sum = dilated_attention_v020_torch(tq, tk, tv, ws, rs, is_causal,
                                          per_group_sum=False).numpy()
    grouped = dilax.dilated_attention(q, k, v, ws, rs, is_causal=is_causal, mode="grouped")
    mixture = dilax.dilated_attention(q, k, v, ws, rs, is_causal=is_causal)
    vs_v020, vs_no_sum, mix = QUICK_START[is_causal]
    assert max_abs(grouped, fixed) <= AGREE
    assert max_abs(grouped, v020) == pytest.approx(vs_v020, rel=REL)
    # without the x.sum line 0.2.0 still differs: its head ranges i*g..(i+1)*g with groups of
    # 3, 3, 2 give heads 4, 5 two branches and heads 6, 7 none
    per_head = np.abs(no_sum - fixed).max(axis=(0, 1, 3))
    assert per_head[:4].max() <= AGREE
    assert per_head.max() == pytest.approx(vs_no_sum, rel=REL)
    assert not np.any(no_sum[:, :, 6:]), "0.2.0 leaves heads 6 and 7 at zero"
    assert max_abs(mixture, grouped) == pytest.approx(mix, rel=REL)


def test_guide_inputs_not_causal():
    torch = pytest.importorskip("torch", reason="torch is not installed: the comparison with "
                                "the PyTorch package is skipped")
    import jax.numpy as jnp

    import dilax
    from benchmarks.torch_ref import (
        dilated_attention_grouped_torch,
        dilated_attention_v020_torch,
    )

    ns = run("inputs")
    q, k, v = ns["q"], ns["k"], ns["v"]
    ws, rs = ns["segment_lengths"], ns["dilation_rates"]
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    fixed = dilated_attention_grouped_torch(tq, tk, tv, ws, rs).numpy()
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    grouped = dilax.dilated_attention(jq, jk, jv, ws, rs, mode="grouped")
    assert max_abs(grouped, fixed) <= AGREE
    assert max_abs(grouped, dilated_attention_v020_torch(tq, tk, tv, ws, rs)) == pytest.approx(
        GUIDE_NOT_CAUSAL[0], rel=REL)
    assert max_abs(dilated_attention_v020_torch(tq, tk, tv, ws, rs, per_group_sum=False),
                   fixed) <= 1e-6
    assert max_abs(dilax.dilated_attention(jq, jk, jv, ws, rs), grouped) == pytest.approx(
        GUIDE_NOT_CAUSAL[1], rel=REL)
