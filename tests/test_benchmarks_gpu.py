"""``python -m benchmarks gpu --interpret``: the GPU benchmark's own run on a CPU, so that the
command cannot rot. One small run (a causal GQA check with valid lengths through the Pallas
interpreter, the refusals of cuDNN, a timed dense row and the decode rows); its values are
checked, not only its shape."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu
from tools.gpu.check import check_shape, tolerance


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    argv = ["--interpret", "--checks", "lengths", "--impls", "pallas,cudnn", "--rows",
            "jax-cudnn,dense,decode", "--passes", "fwd", "--n", "32", "--quiet",
            "--out", str(out)]
    assert gpu.main(argv) == 0  # exit 1 would mean a failed check
    with open(out / "gpu.json") as f:
        data = json.load(f)
    data["_md"] = (out / "gpu.md").read_text()
    return data


def test_check_section_within_tolerance(result):
    checks = {(r["case"], r["implementation"]): r for r in result["checks"]}
    assert set(checks) == {("lengths", "pallas"), ("lengths", "cudnn")}
    ok = checks["lengths", "pallas"]
    s = check_shape(16, interpret=True)
    assert (ok["status"], ok["dtype"], ok["n"], ok["head_dim"]) == ("ok", "float32", s.n, 16)
    assert ok["tolerance"] == tolerance("float32", "cpu") == 1e-5
    assert set(ok["errors"]) == {"out", "dq", "dk", "dv"}
    # the interpreter's float32 kernels agree with the float64 reference to rounding level
    assert 0 <= ok["max_error"] == max(ok["errors"].values()) <= ok["tolerance"]
    refused = checks["lengths", "cudnn"]
    assert refused["status"] == "refused" and "cuDNN" in refused["reason"]
    assert "float32" in refused["reason"]  # the registry's rule: bf16/fp16 only
    assert result["check_summary"] == dict(
        counts={"ok": 1, "refused": 1}, passed=True,
        worst=dict(case="lengths", implementation="pallas", dtype="float32", head_dim=16,
                   max_error=ok["max_error"], tolerance=1e-5))


def test_timed_rows_have_their_fields(result):
    rows = {(r["kernel"], r["pass_"]): r for r in result["rows"]}
    assert set(rows) == {("jax-cudnn", "fwd"), ("dilax-dense pallas", "fwd"),
                         ("dilax-dense cudnn", "fwd")}
    r = rows["dilax-dense pallas", "fwd"]
    n, h, d = 32, 2, 16
    assert (r["status"], r["n"], r["head_dim"], r["heads"], r["causal"]) == ("ok", n, d, h,
                                                                             True)
    assert r["pairs"] == h * n * (n + 1) // 2  # causal: the attended pairs, not n^2
    assert r["flops"] == 4 * d * r["pairs"]
    assert r["ms_min"] <= r["ms_median"] <= r["ms_max"] and r["compile_s"] >= 0
    assert r["tflops"] == pytest.approx(r["flops"] / (r["ms_median"] * 1e-3) / 1e12)
    assert r["pct_peak"] == pytest.approx(100 * r["tflops"] / 989.4)
    for key, word in ((("jax-cudnn", "fwd"), "CUDA GPU"), (("dilax-dense cudnn", "fwd"),
                                                           "bf16/fp16 only")):
        assert rows[key]["status"] == "refused" and word in rows[key]["reason"]
        assert "ms_median" not in rows[key]


def test_decode_rows_and_markdown(result):
    dec = {r["implementation"]: r for r in result["decode"]}
    assert set(dec) == {"pallas", "cudnn"}
    for r in dec.values():  # no decode kernel runs on a CPU for these two: reasons given
        assert r["status"] == "refused" and r["reason"].startswith("ValueError: ")
    md = result["_md"]
    assert "| lengths | pallas | float32 | 16 |" in md and "PASSED" in md
    assert result["device"]["platform"] == "cpu" and result["config"]["interpret"]


def test_budget_guard_skips_with_a_note(tmp_path, capsys):
    """A spent budget runs nothing: every check and row is skipped, each saying why."""
    argv = ["--interpret", "--budget", "0", "--checks", "causal-gqa", "--impls", "xla",
            "--rows", "dense,decode", "--n", "32,64", "--out", str(tmp_path)]
    assert gpu.main(argv) == 0
    data = json.loads((tmp_path / "gpu.json").read_text())
    rows = data["checks"] + data["rows"] + data["decode"]
    assert len(rows) == 1 + 2 * 2 + 1  # 1 check, 2 n x 2 passes, 1 decode context
    assert {r["status"] for r in rows} == {"skipped"}
    assert all(r["reason"].startswith("time budget: ") and "--budget 0 s" in r["reason"]
               for r in rows)
    assert data["budget_skips"] == len(rows)
    assert "time budget: dilax-dense xla n=64 d=16 fwd+bwd skipped" in capsys.readouterr().err
