"""Benchmark plots carry their configuration in the title (issue 30): what a PNG shows can be
read off the PNG alone, for a fresh plot and for every plot committed with its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from benchmarks.report import config_title, plots

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_plot_title_names_shape_dtype_branches_mask_and_machine(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    result = {
        "command": "speed",
        "config": {"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16",
                   "segment_lengths": [512, 1024], "dilation_rates": [1, 2], "causal": True,
                   "mode": "grouped", "local_window": 32},
        "machine": {"cpu": "Some CPU", "cores": 4, "backend": "cpu", "jax": "0.10.2",
                    "date": "2026-11-25 07:00 UTC"},
        "rows": [{"row": row, "pass_": "fwd", "n": n, "ms_median": n / 100.0,
                  "memory_bytes": n * 2**12} for n in (2048, 4096)
                 for row in ("mixture", "mixture-window")],
    }
    titles = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (titles.append(fig.axes[0].get_title()),
                                                   close(fig)))
    paths = plots(result, str(tmp_path), "speed")
    assert [Path(p).name for p in paths] == ["speed_time.png", "speed_memory.png"]
    want = ("b=2 h=8 hk=2 d=64 bfloat16, w=(512, 1024) r=(1, 2), causal, grouped, "
            "local window 32\nSome CPU, 4 cores, cpu, jax 0.10.2, 2026-11-25")
    assert config_title(result) == want
    # a command whose rows use no window does not name the config's (unused) window
    no_window = dict(result, rows=[r for r in result["rows"] if r["row"] == "mixture"])
    assert "local window" not in config_title(no_window)
    assert titles == ["dilax speed: time (ms) vs n\n" + want,
                      "dilax speed: peak memory (MiB) vs n\n" + want]
    for p, t in zip(paths, titles, strict=True):  # the PNG holds it as text as well
        assert Image.open(p).text["Title"] == t


@pytest.mark.parametrize("png", sorted(p.name for p in RESULTS.glob("*_*.png")))
def test_committed_plots_carry_the_configuration_of_their_json(png):
    name = png.rsplit("_", 1)[0]
    result = json.loads((RESULTS / f"{name}.json").read_text())
    assert config_title(result) in Image.open(RESULTS / png).text["Title"]


@pytest.mark.parametrize("name", ["memory", "speed", "demo"])
def test_committed_tables_have_no_empty_column_and_explain_theirs(name):
    """Issue 39: a memory-only table showed seven all-"—" columns and an unexplained "× qkvo".
    Every column of a committed table has a value in some row, and each is explained."""
    from benchmarks.report import markdown

    text = markdown(json.loads((RESULTS / f"{name}.json").read_text()))
    assert text == (RESULTS / f"{name}.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    header, rows = table[0].strip("|").split("|"), [r.strip("|").split("|") for r in table[1:]]
    for i, col in enumerate(header):
        assert any(r[i].strip() not in ("—", "") for r in rows), col
    legend = next(line for line in text.splitlines() if line.startswith("Columns: "))
    for col in header[3:]:
        assert f"{col.strip()}: " in legend, col
