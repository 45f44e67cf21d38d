"""Every code block of README.md and of the docs site's guides (docs/*.md) runs as written, and
the benchmark table of docs/benchmarks.md is the committed demo's.

Fenced blocks are ``python``, ``bash`` or ``text`` (not code); MyST directives (```` ```{toctree}
````, ```` ```{eval-rst} ````) are not code blocks. A code block preceded by ``<!-- not-run:
REASON -->`` is not executed (python ones are still compiled); the reason is required and the
markers are counted. All other python blocks of a page run in order in one namespace of their
own (later blocks use names from earlier ones, as a reader's session would; no page uses
another's), every page in one fresh interpreter with 8 host devices; bash blocks run with
``bash -e`` in a temporary directory, with this interpreter as ``python``. A page whose blocks
another test runs (``RUN_ELSEWHERE``: docs/migration.md, which needs torch for half of them) is
only compiled here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the pages whose code a reader runs: the README and the docs site's Markdown pages
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# pages whose code blocks another test runs, in its own way (here they are only compiled)
RUN_ELSEWHERE = {"docs/migration.md": "tests/test_migration.py (torch side skipped without torch)"}
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->", re.S)
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*|\{[\w-]+\}.*)\s*$")


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    not_run: str | None  # the reason, or None if the block runs


def parse_blocks(text: str) -> list[Block]:
    """Fenced blocks with the ``not-run`` marker (if any) on the lines just above them; MyST
    directives (a fence whose language is ``{name}``) are skipped."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"line {start + 1}: unterminated code block")
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = NOT_RUN.fullmatch(lines[above].strip()) if above >= 0 else None
        if not m.group(1).startswith("{"):
            blocks.append(Block(m.group(1), "\n".join(lines[start + 1:j]) + "\n", start + 1,
                                marker.group(1).strip() if marker else None))
        i = j + 1
    return blocks


BLOCKS = {page: parse_blocks(page.read_text(encoding="utf-8")) for page in PAGES}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_parser_reads_markers_and_languages():
    text = textwrap.dedent("""\
        intro
        <!-- not-run: too slow -->

        ```bash
        make demo
        ```
        ```python
        x = 1
        ```
        ```{toctree}
        page
        ```
        """)
    got = parse_blocks(text)
    assert [(b.lang, b.code, b.line, b.not_run) for b in got] == [
        ("bash", "make demo\n", 4, "too slow"), ("python", "x = 1\n", 7, None)]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_is_code_or_text_and_every_marker_has_a_block_and_reason(page):
    text = page.read_text(encoding="utf-8")
    blocks = BLOCKS[page]
    for b in blocks:
        where = f"{_name(page)} line {b.line}"
        assert b.lang in ("python", "bash", "text"), (
            f"{where}: fence language must be python, bash or text, got {b.lang!r}")
        if b.lang == "text":
            assert b.not_run is None, f"{where}: a text block needs no marker"
        if b.not_run is not None:
            assert b.not_run, f"{where}: not-run marker without a reason"
    markers = NOT_RUN.findall(text)
    attached = [b for b in blocks if b.not_run is not None]
    assert len(markers) == len(attached), (
        f"{_name(page)}: a not-run marker is not directly above a code block")


def _runs_here(page: Path) -> bool:
    return _name(page) not in RUN_ELSEWHERE


def test_pages_run_elsewhere_exist_and_their_tests_too():
    for page, test in RUN_ELSEWHERE.items():
        if (ROOT / page).exists():
            assert (ROOT / test.split()[0]).exists(), (page, test)


def test_most_code_runs():
    code = [(p, b) for p in PAGES if _runs_here(p) for b in BLOCKS[p] if b.lang != "text"]
    attached = [(p, b) for p, b in code if b.not_run is not None]
    print(f"{len(code)} code blocks, {len(code) - len(attached)} run, {len(attached)} not run: "
          + "; ".join(f"{_name(p)} line {b.line}: {b.not_run}" for p, b in attached))
    # the README's three examples run, and most of the guides' code
    assert sum(b.not_run is None and b.lang == "python" for b in BLOCKS[README]) >= 3
    assert len(code) - len(attached) >= 2 * len(attached)


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["XLA_FLAGS"] = xla_flags(8)  # this session's compile-speed flags, 8 host devices
    env["MPLBACKEND"] = "Agg"
    bindir = tmp_path / "bin"  # `python` in the shell blocks is this interpreter
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / "python"  # a script, not a symlink: a venv is found from argv[0]
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    return env


# argv: page, line, code, page, line, code...; each page's blocks in a namespace of its own
_DRIVER = r"""
import sys, traceback
failed = []
namespaces = {}
for page, line, code in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    if page in failed:
        continue
    namespace = namespaces.setdefault(page, {"__name__": "__main__"})
    print(f"--- {page} block at line {line}", flush=True)
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
    except Exception:
        traceback.print_exc()
        failed.append(page)
    sys.stdout.flush()
print("--- failed pages:", failed, flush=True)
sys.exit(1 if failed else 0)
"""


def test_python_blocks_run_in_order(tmp_path):
    argv = [x for page in PAGES if _runs_here(page) for b in BLOCKS[page]
            if b.lang == "python" and b.not_run is None
            for x in (_name(page), str(b.line), b.code)]
    assert argv
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *argv], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "--- failed pages: []" in proc.stdout
    # the sequence-parallel blocks print their error against the single-device op: README's
    # and the guide's whole-mesh call, and the guide's own shard_map
    errors = re.findall(r"(?:8 devices, max error|shard_map max error) ([0-9.e+-]+)",
                        proc.stdout)
    assert len(errors) == 3 and all(float(e) < 1e-5 for e in errors), proc.stdout[-2000:]


def test_not_run_python_blocks_compile():
    for page in PAGES:
        for b in BLOCKS[page]:
            if b.lang == "python" and (b.not_run is not None or not _runs_here(page)):
                compile(b.code, f"{_name(page)}:{b.line}", "exec")


def test_bash_blocks_run(tmp_path):
    blocks = [(page, b) for page in PAGES if _runs_here(page) for b in BLOCKS[page]
              if b.lang == "bash" and b.not_run is None]
    assert blocks
    env = _env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for page, b in blocks:
        proc = subprocess.run(["bash", "-e", "-c", b.code], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (f"{_name(page)} line {b.line}:\n{b.code}\n"
                                      f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        # (tests/test_train_cli.py trains this text and model with these flags: the same
        # compiled programs, once per session; keep the two in step)
        if "dilax.train" in b.code:  # stopped at 20, resumed, sampled with dilax.sample
            assert "resumed from" in proc.stdout and "(step 20)" in proc.stdout, proc.stdout
            names = sorted(p.name for p in (work / "ckpt").iterdir())
            assert [x for x in names if x.isdigit()] == ["20", "30"]
            assert "eval_positions.json" in names  # the per-position eval next to them
            sampled = proc.stdout.rsplit("--tokens 200\n", 1)[1]  # after the last hint
            assert sampled.startswith("Привет"), proc.stdout
            assert len(sampled) == len("Привет") + 40 + 1, proc.stdout  # + the newline


# ------------------------------------------------------------------------- benchmark table

BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def _demo_section(text: str) -> str:
    start = text.index("### `demo` —")
    end = text.index("\n\n", text.index("Same-run fp32", start))
    return text[start:end + 1]


def _fake_demo_result() -> dict:
    return dict(
        command="demo",
        config=dict(batch=1, heads=2, kv_heads=1, head_dim=8, dtype="float32",
                    segment_lengths=[4, 8], dilation_rates=[1, 2], causal=False),
        machine=dict(date="2000-01-01 00:00 UTC", cpu="fake cpu", cores=1, backend="cpu",
                     jax="0.0"),
        rows=[dict(row="mixture", n=8, pass_="fwd", ms_median=1.0, ms_min=0.5, ms_max=2.0,
                   gflops=1.0, pct_matmul=10.0, vs_dense=0.5, memory_bytes=1024,
                   memory_over_floor=1.5,
                   tokens_per_s=8.0, matmul_gflops=10.0)],
    )


def test_benchmarks_table_header_is_the_demo_report_header():
    from benchmarks.report import markdown

    generated = markdown(_fake_demo_result()).splitlines()
    page = _demo_section(BENCHMARKS.read_text()).splitlines()
    # the "### `demo` — date, cpu (cores, backend, jax)" title has the report's shape
    title = re.escape(generated[0])
    for field in ("2000-01-01 00:00 UTC", "fake cpu", "1", "cpu", "0.0"):
        title = title.replace(re.escape(field), ".+", 1)
    assert re.fullmatch(title, page[0]), (page[0], generated[0])
    header = [line for line in generated if line.startswith("| row |")]
    assert len(header) == 1
    i = generated.index(header[0])
    assert header[0] in page, f"the demo table header differs from the report's:\n{header[0]}"
    j = page.index(header[0])
    assert page[j + 1] == generated[i + 1]  # the alignment row


def test_benchmarks_page_shows_the_committed_demo_result():
    import json

    from benchmarks.report import markdown

    results = ROOT / "benchmarks" / "results"
    committed = (results / "demo.md").read_text()
    assert markdown(json.loads((results / "demo.json").read_text())) == committed
    assert _demo_section(BENCHMARKS.read_text()) == committed


def test_readme_demo_figures_are_the_committed_ones():
    """The README's headline row quotes the committed demo at n = 4096, forward."""
    committed = (ROOT / "benchmarks" / "results" / "demo.md").read_text()
    header = [c.strip() for c in next(r for r in committed.splitlines()
                                      if r.startswith("| row |")).split("|")]
    time_col, mem_col = header.index("median ms (min–max)"), header.index("peak memory")
    rows = {r.split("|")[1].strip(): r.split("|") for r in committed.splitlines()
            if re.match(r"\| \w+ \| 4,096 \| fwd \|", r)}
    line = next(x for x in README.read_text().splitlines() if x.startswith("| `make demo`"))
    for row, ms, mem in (("dense", 848, "1.03 GiB"), ("mixture", 86, "56 MiB"),
                         ("grouped", 28, "40 MiB")):
        cells = rows[row]
        assert round(float(cells[time_col].split()[0])) == ms, (row, cells[time_col])
        assert f"{ms} ms" in line and mem in line, (row, line)
        value, unit = cells[mem_col].split()
        assert mem == (f"{float(value):.2f} {unit}" if unit == "GiB"
                       else f"{round(float(value))} {unit}"), (row, cells[mem_col])
