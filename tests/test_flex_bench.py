"""``python -m benchmarks flex`` (issue 38, "speed"): the files it writes and that every ratio
is read off its own timings (no test asserts a wall time). Tiny: n = 128, the documents group
only, and an A/B whose two sides are this checkout (same programs, so same HLO and memory)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import flex

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("flex")
    full = flex.groups
    mp = pytest.MonkeyPatch()
    # the documents group: the built-in segment_ids row and the mask_mod + block_mask row
    mp.setattr(flex, "groups", lambda bs: {"documents, causal": dict(
        list(full(bs)["documents, causal"].items())[:2])})
    try:
        assert flex.main(["--n", "128", "--repeats", "3", "--rounds", "2", "--block-size",
                          "64", "64", "--base-tree", str(ROOT), "--ab-rows", "plain causal",
                          "--out", str(out), "--quiet"]) == 0
    finally:
        mp.undo()
    return json.loads((out / "flex.json").read_text()), (out / "flex.md").read_text()


def _check_ratio(new, base):
    per = [a / b for a, b in zip(new["ms"], base["ms"], strict=True)]
    assert new["ratio"] == pytest.approx(new["ms_median"] / base["ms_median"], rel=1e-12)
    assert (new["ratio_min"], new["ratio_max"]) == pytest.approx((min(per), max(per)))
    for x in (new, base):
        assert x["cpu_ms_median"] == statistics.median(x["cpu_ms"]) > 0
    assert new["cpu_ratio"] == pytest.approx(new["cpu_ms_median"] / base["cpu_ms_median"],
                                             rel=1e-12)


def test_rows_ratios_are_medians_of_their_own_timings(result):
    res, md = result
    assert res["config"]["n"] == 128 and res["config"]["repeats"] == 3
    assert res["platform"].startswith("XLA core on cpu")
    rows = {(r["row"], r["pass_"]): r for r in res["rows"]}
    assert set(rows) == {(r, p) for r in ("dot_product_attention segment_ids",
                                          "dot_product_attention mask_mod + block_mask")
                         for p in ("fwd", "fwd+bwd")}
    for r in rows.values():
        assert len(r["ms"]) == 3 and r["ms_median"] == statistics.median(r["ms"])
        assert r["memory"]["temp"] > 0 and r["memory"]["argument"] > 0
    for p in ("fwd", "fwd+bwd"):
        new, base = rows["dot_product_attention mask_mod + block_mask", p], \
            rows["dot_product_attention segment_ids", p]
        assert new["vs"] == base["row"] and "ratio" not in base
        _check_ratio(new, base)
        key = f"documents, causal: {new['row']} / {base['row']}, {p}"
        assert res["summary"][key] == dict(ratio=round(new["ratio"], 3),
                                           cpu_ratio=round(new["cpu_ratio"], 3), target=1.15,
                                           ok=new["ratio"] <= 1.15)
        assert f"| {new['ratio']:.3f} (" in md
    assert "Load average before / after" in md and res["load_before"]["loadavg"]


def test_ab_of_a_checkout_against_itself(result):
    res, md = result
    assert [(r["row"], r["pass_"]) for r in res["ab"]] == [("plain causal", "fwd"),
                                                            ("plain causal", "fwd+bwd")]
    for r in res["ab"]:
        assert len(r["base"]["ms"]) == len(r["new"]["ms"]) == 2
        _check_ratio(r["new"] | {k: r[k] for k in ("ratio", "ratio_min", "ratio_max",
                                                    "cpu_ratio")}, r["base"])
        # both workers imported this checkout: the same program, hence the same memory
        assert r["dilax_base"] == r["dilax_new"] == str(ROOT / "dilax" / "__init__.py")
        assert r["same_hlo"] and r["memory_equal"] and r["memory_base"]["temp"] > 0
        assert res["summary"][f"A/B new / base: plain causal, {r['pass_']}"]["ratio"] == \
            round(r["ratio"], 3)
    assert "| plain causal | fwd+bwd |" in md
