"""``python -m benchmarks quality`` (issue 40) in a tiny form, ``python -m dilax.train
--attention`` and the mixture-mode warning for branches with fewer heads than their rate."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dilax.dilated.settings import warn_uncovered_offsets
from dilax.semantics import branch_mask, window_mask

# ----------------------------------------------------------------------------- the command

TINY = ["--quick", "--arms", "dense,longnet", "--probe-arms", "longnet", "--seeds", "1",
        "--steps", "3", "--probe-steps", "2", "--d-model", "16", "--num-heads", "4",
        "--num-layers", "1", "--dim-feedforward", "32", "--short", "16", "--factor", "4",
        "--batch", "2", "--eval-windows", "2", "--probe-batch", "4", "--probe-eval", "10",
        "--local-window", "4", "--max-bytes", "100000", "--quiet"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from benchmarks import quality

    out = tmp_path_factory.mktemp("quality")
    assert quality.main([*TINY, "--out", str(out), "--name", "q"]) == 0
    return out, json.loads((out / "q.json").read_text())


def _brute_pairs(n: int, heads: int, ws, rs, window=None) -> int:
    """Causal (head, query, key) pairs counted on the explicit masks of every branch."""
    total = 0
    for j in range(heads):
        for w, r in zip(ws, rs):
            total += int(branch_mask(n, w, r, j % r, True).sum())
        if window is not None:
            total += int(window_mask(n, window, True).sum())
    return total


def test_quality_outputs(tiny_run):
    out, res = tiny_run
    for name in ("q.json", "q.md", "q_curves.png", "q_positions.png", "q_probe.png"):
        assert (out / name).stat().st_size > 0, name
    assert res["command"] == "quality"
    assert [r["arm"] for r in res["rows"]] == ["dense", "longnet"]
    short, long_ = res["eval_lengths"]
    assert (short, long_) == (16, 64)
    for r in res["rows"]:
        assert r["seeds"] == 1
        for n in (short, long_):
            bpb = r["bpb"][str(n)]["mean"]
            assert 0 < bpb < 10, (r["arm"], n, bpb)  # near log2(256) = 8 untrained
        assert len(r["position_bpb"]) == 16 and all(np.isfinite(r["position_bpb"]))
        assert r["curve"][-1][0] == 3
    dense = res["rows"][0]
    # beyond its training length the dense arm runs blockwise on blocks of its length: the
    # same rows as the short evaluation, so the same bits per byte
    assert dense["bpb"]["16"]["mean"] == pytest.approx(dense["bpb"]["64"]["mean"], rel=1e-5)
    probe = res["probe"][0]
    assert probe["arm"] == "longnet"
    assert all(0 <= a["mean"] <= 1 for a in probe["accuracy"])
    assert all(0 <= a["mean"] <= 1 for a in probe["accuracy_2x"])  # at twice the length
    assert probe["buckets_2x"][-1][1] == 2 * probe["buckets"][-1][1] + 1  # to 2n - 2
    assert "reach ends at" in (out / "q.md").read_text()
    md = (out / "q.md").read_text()
    assert "| dense | 16 |" in md and "| longnet | 64 |" in md and "Key-value recall" in md


def test_quality_pairs_match_brute_force(tiny_run):
    """The table's attended pairs per row against a count of the explicit masks."""
    _, res = tiny_run
    by = {r["arm"]: r for r in res["rows"]}
    assert by["dense"]["attended_pairs_per_row"] == _brute_pairs(16, 4, (16,), (1,))
    assert by["longnet"]["attended_pairs_per_row"] == _brute_pairs(64, 4, (16, 32, 64),
                                                                   (1, 2, 4))
    flops = 14 * 4 * by["longnet"]["attended_pairs_per_token"] * 1 * 3 * 2 * 64
    assert by["longnet"]["attention_train_flops"] == pytest.approx(flops)


def test_quality_sparse_and_window_pairs():
    """The sparse arm's pattern counted on its token mask, and the window arm's pairs."""
    from benchmarks import quality_setup
    from dilax.patterns import local_strided

    s = dict(quality_setup.QUICK, short=16, factor=4, num_heads=4, local_window=4)
    arms = {a.name: a for a in quality_setup.make_arms(s)}
    fields = arms["sparse"].model_fields()
    pat = local_strided(64, *fields["block_sparse"]).expanded_mask(64)
    causal = pat & np.tri(64, dtype=bool)
    longnet = quality_setup.pairs_of(64, 4, arms["longnet"].model_fields())
    sparse = quality_setup.pairs_of(64, 4, fields)
    assert sparse == 4 * int(causal.sum())
    assert abs(sparse - longnet) / longnet < 0.2  # matched to LongNet's
    assert quality_setup.pairs_of(64, 4, arms["longnet+window"].model_fields()) == _brute_pairs(
        64, 4, (16, 32, 64), (1, 2, 4), window=4)


def test_quality_resume_skips_cached(tiny_run, capsys):
    from benchmarks import quality

    out, first = tiny_run
    assert quality.main([*TINY, "--out", str(out), "--name", "q"]) == 0
    again = json.loads((out / "q.json").read_text())
    assert again["runs_cached_before"] == 3  # 2 LM runs + 1 probe run, none retrained
    assert again["rows"][1]["bpb"] == first["rows"][1]["bpb"]


def _reach_brute_force(n, fields, d):
    """Structural reach of 2 layers by enumeration: some x reads p - 1 and p, q reads x."""
    from dilax.semantics import dilated_counts

    c = dilated_counts(n, 4, fields["segment_lengths"], fields["dilation_rates"], "mixture",
                       True, fields.get("local_window")).any(0) | np.eye(n, dtype=bool)
    hits = [any(c[x, p - 1] and c[x, p] and c[p + d, x] for x in range(n))
            for p in range(1, n - d)]
    return np.mean(hits)


@pytest.mark.parametrize("fields", [
    dict(segment_lengths=(16, 32), dilation_rates=(1, 2)),
    dict(segment_lengths=(16,), dilation_rates=(1,)),
    dict(segment_lengths=(32,), dilation_rates=(2,), local_window=3),
    dict(segment_lengths=(32,), dilation_rates=(4,))])
def test_structural_reach_matches_enumeration(fields):
    from benchmarks import quality_setup

    buckets = [(d, d + 1) for d in (1, 5, 15, 16, 20, 30)]
    got = quality_setup.structural_reach(32, 4, 2, fields, buckets)
    want = [_reach_brute_force(32, fields, d) for d, _ in buckets]
    np.testing.assert_allclose(got, want)
    if fields["dilation_rates"] == (4,):  # a rate-4 branch alone: key and value never meet
        assert max(got) == 0


def test_quality_data_split_is_stable():
    from benchmarks import quality_setup

    assert quality_setup.is_held_out("os.py") == quality_setup.is_held_out("os.py")
    files = [rel for rel, _ in quality_setup.stdlib_files()][:400]
    held = sum(map(quality_setup.is_held_out, files))
    assert 0 < held < len(files) // 4
    dist = np.arange(1, 9) * 7
    x, t, d = quality_setup.probe_batch(0, 0, 8, 64, 3, 1, dist)
    rows, q = np.nonzero(d >= 0)
    assert (rows == np.arange(8)).all() and (d[rows, q] == dist).all()  # one query per row
    vpos = q - dist
    assert (x[rows, q] == x[rows, vpos - 1]).all()  # the query is the key before the value
    assert (t[rows, q] == x[rows, vpos]).all()  # the target is that value
    assert (np.sort(x, axis=1) >= 0).all() and (x < 64).all()
    assert ((x >= 48).sum(axis=1) == 3).all()  # each value once: 1 queried + 2 distractors
    x, t, d = quality_setup.probe_batch(0, 1, 4, 64, 1, 5)
    assert ((t >= 0).sum(axis=1) == 5).all() and (d[t >= 0] > 0).all()


# ----------------------------------------------------------------------------- --attention


def test_train_attention_flag():
    from dilax.train.cli import configs_from_argv

    _, m = configs_from_argv(["--attention", "dense", "--seq-len", "64"])
    assert (m.attention, m.segment_lengths, m.dilation_rates) == ("dense", (64,), (1,))
    _, m = configs_from_argv(["--attention", "block-sparse", "--sparse-pattern", "16,32,4",
                              "--seq-len", "64"])
    assert (m.attention, m.block_sparse) == ("block-sparse", (16, 32, 4))
    _, m = configs_from_argv([])
    assert (m.attention, m.block_sparse) == ("dilated", None)
    bad = {
        ("--attention", "dense", "--segment-lengths", "32"): "does not take --segment-lengths",
        ("--sparse-pattern", "16,32,4"): "needs --attention block-sparse",
        ("--attention", "block-sparse", "--sparse-pattern", "16,32"): "--sparse-pattern",
        ("--attention", "block-sparse", "--sparse-pattern", "0,32,4"): "block_size > 0",
        ("--attention", "block-sparse", "--local-window", "8"): "--local-window",
        ("--attention", "sparse"): "invalid choice",
    }
    for argv, match in bad.items():
        with pytest.raises(ValueError, match=match):
            configs_from_argv(list(argv))


def test_checkpoints_without_the_attention_fields_still_load():
    """A model config saved before --attention (no attention/block_sparse) is a dilated one."""
    from dilax.train.checkpoints import _check_model_config
    from dilax.train.config import ModelConfig

    m = ModelConfig(vocab="ab")
    old = {k: v for k, v in m.to_json().items() if k not in ("attention", "block_sparse")}
    assert ModelConfig.from_json(old) == m
    _check_model_config({"model_config": old}, m, "old")  # no difference reported
    bs = ModelConfig(vocab="ab", attention="block-sparse", block_sparse=(8, 8, 2))
    assert ModelConfig.from_json(json.loads(json.dumps(bs.to_json()))) == bs


def test_train_block_sparse_model_is_causal():
    """make_model of --attention block-sparse: a causal LM over local + strided blocks."""
    from dilax.train.cli import configs_from_argv
    from dilax.train.steps import make_model

    _, m = configs_from_argv(["--attention", "block-sparse", "--sparse-pattern", "8,8,2",
                              "--seq-len", "32", "--d-model", "16", "--num-heads", "2",
                              "--num-layers", "1", "--dim-feedforward", "16"])
    model = make_model(m, 0)
    x = jnp.asarray(np.random.default_rng(0).integers(0, len(m.vocab), (1, 32)), jnp.int32)
    y = x.at[0, 20].set((x[0, 20] + 1) % len(m.vocab))
    a, b = model(x, deterministic=True), model(y, deterministic=True)
    assert bool(jnp.isfinite(a).all())
    np.testing.assert_array_equal(np.asarray(a[0, :20]), np.asarray(b[0, :20]))
    assert not np.allclose(np.asarray(a[0, 20:]), np.asarray(b[0, 20:]))
    with pytest.raises(NotImplementedError, match="block_sparse"):
        model.long_net.decoder[0].self_attn.decode(jnp.zeros((1, 1, 16)), None)
    # no KV-cache decoding: dilax.train's sampler recomputes the window for every token
    from dilax.train.config import CharTokenizer
    from dilax.train.sampling import sample

    tok = CharTokenizer(m.vocab)
    prompt = m.vocab[10:14]
    text = sample(model, tok, prompt, 2, 32, 0.0, jax.random.key(0))
    assert text.startswith(prompt) and len(text) == 6
    greedy = tok.encode(prompt).tolist()
    for _ in range(2):  # greedy = the argmax of the full forward pass, token by token
        logits = model(jnp.asarray([greedy]), deterministic=True)[0, -1]
        greedy.append(int(jnp.argmax(logits)))
    assert text == tok.decode(greedy)


# ----------------------------------------------------------------------------- the warning


def test_mixture_warns_for_uncovered_offsets():
    import dilax

    q = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 2, 8))
    with pytest.warns(UserWarning, match=r"branch 1 \(segment_length=32, dilation_rate=4\).*"
                                         r"offsets \{2, 3\}"):
        dilax.dilated_attention(q, q, q, (16, 32), (1, 4))
    with warnings.catch_warnings():  # once per configuration, not per call
        warnings.simplefilter("error")
        dilax.dilated_attention(q, q, q, (16, 32), (1, 4))
        # enough heads, or grouped mode (one offset per group by design): no warning
        dilax.dilated_attention(q, q, q, (16, 32), (1, 2))
        dilax.dilated_attention(q, q, q, (16, 32), (1, 4), mode="grouped")


def test_model_warns_for_uncovered_offsets():
    from flax import nnx

    from dilax.models import LongNetLM

    with pytest.warns(UserWarning, match=r"branch 2 .*dilation_rate=8.*offsets "
                                         r"\{3, 4, 5, 6, 7\}"):
        LongNetLM(16, 12, 3, 0, 1, 16, (8, 16, 64), (1, 2, 8), rngs=nnx.Rngs(0))
    assert warn_uncovered_offsets(3, (8, 16, 64), (1, 2, 8), "mixture") == (2,)
    assert warn_uncovered_offsets(8, (8, 16, 64), (1, 2, 8), "mixture") == ()


def test_quality_ctrl_c_keeps_finished_runs(tmp_path, monkeypatch):
    """Ctrl-C during a run: the finished runs stay cached, main returns 130, and the rerun
    trains only the rest (the training itself faked: this tests the bookkeeping)."""
    from benchmarks import quality

    calls = []

    def fake_lm(s, arm, seed, data, tick=None):
        calls.append(("lm", arm.name, seed))
        if len(calls) == 2 and interrupt:
            raise KeyboardInterrupt
        short, long_ = s["short"], s["short"] * s["factor"]
        return dict(arm=arm.name, seed=seed, train_len=arm.train_len,
                    bpb={str(short): 5.0, str(long_): 4.0}, curve=[[1, 6.0], [2, 5.0]],
                    position_bpb=[4.0] * 16, first_step_s=1.0, step_s=0.1, eval_s=0.1)

    def fake_probe(s, arm, seed, tick=None):
        calls.append(("probe", arm.name, seed))
        b = quality.distance_buckets(s)
        return dict(arm=arm.name, seed=seed, buckets=b, accuracy=[0.5] * len(b),
                    final_loss=1.0, first_step_s=1.0, step_s=0.1)

    monkeypatch.setattr(quality, "run_lm", fake_lm)
    monkeypatch.setattr(quality, "run_probe", fake_probe)
    argv = [*TINY, "--arms", "dense,sparse,longnet", "--out", str(tmp_path), "--name", "c"]
    interrupt = True
    assert quality.main(argv) == 130
    assert [p.name for p in (tmp_path / "c-cache").iterdir()] == ["lm-dense-seed0.json"]
    assert not (tmp_path / "c.json").exists()
    calls.clear()
    interrupt = False
    assert quality.main(argv) == 0
    assert calls == [("lm", "sparse", 0), ("lm", "longnet", 0), ("probe", "longnet", 0)]
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["runs_cached_before"] == 1 and len(res["rows"]) == 3


@pytest.mark.parametrize("name", ["quality", "quality-quick", "quality-quick-probe800",
                                  "quality-estimate"])
def test_committed_quality_tables_match_their_json(name):
    """The committed Markdown is what the JSON renders to (nothing edited by hand)."""
    from pathlib import Path

    from benchmarks.report import markdown

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    result = json.loads((results / f"{name}.json").read_text())
    assert markdown(result) == (results / f"{name}.md").read_text()
