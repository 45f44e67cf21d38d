"""Patterns: every constructor against an independent token-level / brute-force definition,
the compact tables against per-row ``np.nonzero``, combination, density, visualisation and
errors. NumPy only (fast)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dilax import patterns as P
from dilax.reference import dilated_counts


def block_cover(token_mask: np.ndarray, block_size: int) -> np.ndarray:
    """``(H, n, n)`` token mask -> ``(H, nb, nb)``: a block is active iff any pair in it is."""
    H, n, _ = token_mask.shape
    nb = -(-n // block_size)
    padded = np.zeros((H, nb * block_size, nb * block_size), bool)
    padded[:, :n, :n] = token_mask
    return padded.reshape(H, nb, block_size, nb, block_size).any(axis=(2, 4))


def brute_tables(mask: np.ndarray, is_causal: bool):
    H, nq, nk = mask.shape
    rows = []
    for hd in range(H):
        for i in range(nq):
            active = [j for j in range(nk) if mask[hd, i, j] and (not is_causal or j <= i)]
            rows.append(active)
    max_active = max(1, max(len(r) for r in rows))
    idx = np.zeros((H * nq, max_active), np.int32)
    cnt = np.zeros(H * nq, np.int32)
    for r, active in enumerate(rows):
        cnt[r] = len(active)
        fill = active[-1] if active else 0
        idx[r] = active + [fill] * (max_active - len(active))
    return idx.reshape(H, nq, max_active), cnt.reshape(H, nq)


# -- constructors against independent definitions -----------------------------------------


@pytest.mark.parametrize("n,bs,window", [(64, 8, 0), (64, 8, 1), (64, 8, 9), (60, 8, 17),
                                         (50, 16, 100)])
def test_local_window_is_block_cover_of_token_window(n, bs, window):
    pos = np.arange(n)
    token = np.abs(pos[:, None] - pos[None, :]) <= window
    np.testing.assert_array_equal(P.local_window(n, bs, window).block_mask,
                                  block_cover(token[None], bs))


@pytest.mark.parametrize("n,bs,g,window", [(64, 8, 0, 8), (64, 8, 5, 3), (60, 8, 17, 0)])
def test_global_local_is_block_cover(n, bs, g, window):
    pos = np.arange(n)
    token = (np.abs(pos[:, None] - pos[None, :]) <= window) | (pos[:, None] < g) | (
        pos[None, :] < g)
    np.testing.assert_array_equal(P.global_local(n, bs, g, window).block_mask,
                                  block_cover(token[None], bs))


@pytest.mark.parametrize("rates", [(1,), (3,), (2, 3), (4, 6)])
def test_dilated_matches_definition(rates):
    pat = P.dilated(80, 8, rates)
    expect = np.zeros((10, 10), bool)
    for i in range(10):
        for j in range(10):
            expect[i, j] = any((i - j) % r == 0 for r in rates)
    np.testing.assert_array_equal(pat.block_mask[0], expect)
    if 1 in rates:
        assert pat.density == 1.0


@pytest.mark.parametrize("mode", ["mixture", "grouped"])
@pytest.mark.parametrize("n,bs,ws,rs", [(64, 8, (16, 32), (1, 2)), (70, 8, (24, 48), (3, 6)),
                                        (64, 4, (64,), (8,))])
def test_dilated_segments_is_block_cover_of_dilated_counts(mode, n, bs, ws, rs):
    h = 4
    per_head = P.dilated_segments(n, bs, ws, rs, num_heads=h, mode=mode)
    token = dilated_counts(n, h, ws, rs, mode, False) > 0
    np.testing.assert_array_equal(per_head.block_mask, block_cover(token, bs))
    # The shared cover is the union over every offset (covers every head of any h).
    shared = P.dilated_segments(n, bs, ws, rs)
    assert shared.num_heads == 1
    all_offsets = dilated_counts(n, max(rs) * len(rs), ws, rs, "mixture", False) > 0
    np.testing.assert_array_equal(shared.block_mask[0], block_cover(all_offsets, bs).any(0))


def test_hierarchical_matches_definition():
    n, levels = 256, ((8, 1), (32, 1), (128, 1))
    pat = P.hierarchical(n, levels)
    nb = n // 8
    expect = np.zeros((nb, nb), bool)
    for i in range(nb):
        for j in range(nb):
            for s, k in levels:
                ratio = s // 8
                if j % ratio == 0 and abs(i // ratio - j // ratio) <= k:
                    expect[i, j] = True
    np.testing.assert_array_equal(pat.block_mask[0], expect)
    assert pat.block_size == 8
    # Dense near the diagonal, one representative per coarse block farther away.
    assert pat.block_mask[0, 10, 9:12].all() and pat.block_mask[0, 10, 4] and not pat.block_mask[
        0, 10, 5]


def test_random_exact_density_deterministic_and_per_head():
    a = P.random(128, 8, 0.25, seed=3)
    assert a.num_active_blocks() == round(0.25 * 256) and a == P.random(128, 8, 0.25, seed=3)
    assert a != P.random(128, 8, 0.25, seed=4)
    ph = P.random(128, 8, 0.1, seed=1, num_heads=3)
    assert ph.num_heads == 3 and (ph.block_mask.sum(axis=(1, 2)) == round(0.1 * 256)).all()
    assert not (ph.block_mask[0] == ph.block_mask[1]).all()
    assert P.random(64, 8, 0.0).num_active_blocks() == 0
    assert P.random(64, 8, 1.0).density == 1.0


def test_from_mask_roundtrip_hash_and_eq():
    rng = np.random.default_rng(0)
    m = rng.random((3, 5, 7)) < 0.4
    pat = P.from_mask(m, 4)
    np.testing.assert_array_equal(pat.block_mask, m)
    assert pat.shape == (3, 5, 7) and pat.block_size == 4
    assert hash(pat) == hash(P.from_mask(m.copy(), 4)) and pat == P.from_mask(m.astype(int), 4)
    assert pat != P.from_mask(m, 8)
    assert {pat: 1}[P.from_mask(m, 4)] == 1
    with pytest.raises(ValueError):
        pat.block_mask[0, 0, 0] = True  # read-only view


def test_combine_or_and_with_broadcast():
    rng = np.random.default_rng(1)
    a = rng.random((4, 6, 6)) < 0.3
    b = rng.random((6, 6)) < 0.5
    pa, pb = P.from_mask(a, 8), P.from_mask(b, 8)
    np.testing.assert_array_equal((pa | pb).block_mask, a | b[None])
    np.testing.assert_array_equal((pb & pa).block_mask, a & b[None])
    lw = P.local_window(48, 8, 8)
    np.testing.assert_array_equal((lw | pb).block_mask[0], lw.block_mask[0] | b)


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 3),
    nq=st.integers(1, 9),
    p=st.floats(0.0, 1.0),
    empty_row=st.booleans(),
    seed=st.integers(0, 2**16),
    is_causal=st.booleans(),
)
def test_tables_match_brute_force(heads, nq, p, empty_row, seed, is_causal):
    rng = np.random.default_rng(seed)
    mask = rng.random((heads, nq, nq)) < p
    if empty_row:
        mask[rng.integers(heads), rng.integers(nq)] = False
    pat = P.from_mask(mask, 4)
    idx, cnt = pat.tables(is_causal)
    e_idx, e_cnt = brute_tables(mask, is_causal)
    assert idx.dtype == np.int32 and cnt.dtype == np.int32
    np.testing.assert_array_equal(idx, e_idx)
    np.testing.assert_array_equal(cnt, e_cnt)
    kept = mask & (np.tril(np.ones((nq, nq), bool)) if is_causal else True)
    assert pat.num_active_blocks(is_causal) == kept.sum()
    dens = pat.causal_density if is_causal else pat.density
    assert dens == pytest.approx(kept.sum() / mask.size)


def test_causal_density_of_full_mask():
    pat = P.from_mask(np.ones((8, 8), bool), 16)
    assert pat.density == 1.0 and pat.sparsity == 0.0
    assert pat.causal_density == pytest.approx(9 / 16)


def test_expanded_mask_partial_block():
    pat = P.from_mask(np.array([[1, 0], [1, 1]], bool), 4)
    m = pat.expanded_mask(6, is_causal=False)[0]
    assert m.shape == (6, 6)
    assert m[:4, :4].all() and not m[:4, 4:].any() and m[4:, :].all()
    mc = pat.expanded_mask(6, is_causal=True)[0]
    np.testing.assert_array_equal(mc, m & np.tril(np.ones((6, 6), bool)))


def test_show_text_and_plot_png(tmp_path, capsys):
    pat = P.from_mask(np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool), 4)
    text = pat.to_text()
    assert text.splitlines()[1:] == ["#..", "##.", ".##"]
    pat.show()
    assert "##." in capsys.readouterr().out
    big = P.local_window(2048, 8, 0)  # 256 blocks -> pooled 4x4 to 64 columns
    lines = big.to_text(max_blocks=64).splitlines()
    assert len(lines) == 65 and all(len(line) == 64 for line in lines[1:])
    assert lines[1] == "#" + "." * 63 and "4x4 blocks" in lines[0]
    path = tmp_path / "pattern.png"
    pytest.importorskip("matplotlib")
    fig = P.random(64, 8, 0.3, num_heads=2).plot(str(path), is_causal=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 2
    # the figure is pyplot's current one: plt.savefig writes it, not a blank page
    import matplotlib.pyplot as plt

    assert plt.gcf() is fig
    plt.savefig(tmp_path / "via_pyplot.png")
    img = plt.imread(tmp_path / "via_pyplot.png")
    assert (img[..., :3] < 0.5).mean() > 0.01  # the black blocks are there
    # and every label lies inside the figure ("query block" was clipped)
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        for label in (ax.xaxis.label, ax.yaxis.label, ax.title):
            b = label.get_window_extent(renderer)
            assert box.x0 <= b.x0 and b.x1 <= box.x1 and box.y0 <= b.y0 and b.y1 <= box.y1, (
                label.get_text(), b, box)
    plt.close(fig)


@pytest.mark.parametrize("call,fragment", [
    (lambda: P.local_window(0, 8, 1), "n must be a positive"),
    (lambda: P.local_window(64, 0, 1), "block_size must be a positive"),
    (lambda: P.local_window(64, 8, -1), "window must be a non-negative"),
    (lambda: P.dilated(64, 8, ()), "dilation_rates must hold"),
    (lambda: P.dilated(64, 8, (2, 0)), "dilation_rates[1] must be positive"),
    (lambda: P.global_local(64, 8, 65, 1), "global_tokens must be <= n"),
    (lambda: P.hierarchical(64, ()), "levels must hold"),
    (lambda: P.hierarchical(64, ((8, 1), (12, 1))), "strictly larger multiple"),
    (lambda: P.hierarchical(64, ((8, 1, 2),)), "levels[0] must be a"),
    (lambda: P.random(64, 8, 1.5), "density must be in [0, 1]"),
    (lambda: P.from_mask(np.ones((2, 2, 2, 2)), 8), "block_mask must have shape"),
    (lambda: P.from_mask(np.full((2, 2), 2), 8), "only bools or 0/1"),
    (lambda: P.from_mask(np.ones((0, 2)), 8), "non-empty"),
    (lambda: P.dilated_segments(64, 8, (16,), (3,)), "divisible by dilation_rates"),
    (lambda: P.local_window(64, 8, 1) | P.local_window(64, 16, 1), "block_size"),
    (lambda: P.local_window(64, 8, 1) & P.local_window(128, 8, 1), "blocks"),
    (lambda: P.random(64, 8, .5, num_heads=2) | P.random(64, 8, .5, num_heads=3), "heads"),
])
def test_errors(call, fragment):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert fragment in str(info.value)


def test_type_errors():
    with pytest.raises(TypeError, match="density"):
        P.random(64, 8, "0.5")
    with pytest.raises(TypeError, match="window"):
        P.local_window(64, 8, 1.5)
    with pytest.raises(TypeError, match="is_causal"):
        P.local_window(64, 8, 1).tables(is_causal=1)
