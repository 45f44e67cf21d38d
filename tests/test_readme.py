"""Every code block in README.md runs as written, and its benchmark table is the demo's.

Fenced blocks are ``python``, ``bash`` or ``text`` (not code). A code block preceded by
``<!-- not-run: REASON -->`` is not executed (python ones are still compiled); the reason is
required and the markers are counted. All other python blocks run in order in one fresh
interpreter with 8 host devices (later blocks use names from earlier ones, as a reader's
session would); bash blocks run with ``bash -e`` in a temporary directory, with this
interpreter as ``python``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->", re.S)
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    not_run: str | None  # the reason, or None if the block runs


def parse_blocks(text: str) -> list[Block]:
    """Fenced blocks with the ``not-run`` marker (if any) on the lines just above them."""
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
            raise AssertionError(f"README line {start + 1}: unterminated code block")
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        marker = NOT_RUN.fullmatch(lines[above].strip()) if above >= 0 else None
        blocks.append(Block(m.group(1), "\n".join(lines[start + 1:j]) + "\n", start + 1,
                            marker.group(1).strip() if marker else None))
        i = j + 1
    return blocks


BLOCKS = parse_blocks(README.read_text())


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
        """)
    got = parse_blocks(text)
    assert [(b.lang, b.code, b.line, b.not_run) for b in got] == [
        ("bash", "make demo\n", 4, "too slow"), ("python", "x = 1\n", 7, None)]


def test_every_block_is_code_or_text_and_every_marker_has_a_block_and_reason():
    text = README.read_text()
    assert BLOCKS, "README has no code blocks"
    for b in BLOCKS:
        assert b.lang in ("python", "bash", "text"), (
            f"README line {b.line}: fence language must be python, bash or text, got {b.lang!r}")
        if b.lang == "text":
            assert b.not_run is None, f"README line {b.line}: a text block needs no marker"
        if b.not_run is not None:
            assert b.not_run, f"README line {b.line}: not-run marker without a reason"
    markers = NOT_RUN.findall(text)
    attached = [b for b in BLOCKS if b.not_run is not None]
    assert len(markers) == len(attached), "a not-run marker is not directly above a code block"
    code = [b for b in BLOCKS if b.lang != "text"]
    print(f"README: {len(code)} code blocks, {len(code) - len(attached)} run, "
          f"{len(attached)} not run: " + "; ".join(f"line {b.line}: {b.not_run}"
                                                  for b in attached))
    # Most of the README is exercised: the quick start, sequence parallel and training run.
    assert len(code) - len(attached) >= 4


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


_DRIVER = r"""
import sys
blocks = [(int(line), code) for line, code in zip(sys.argv[1::2], sys.argv[2::2])]
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"--- README block at line {line}", flush=True)
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
print("--- all README python blocks ran", flush=True)
"""


def test_python_blocks_run_in_order(tmp_path):
    blocks = [b for b in BLOCKS if b.lang == "python" and b.not_run is None]
    assert blocks
    argv = [x for b in blocks for x in (str(b.line), b.code)]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, *argv], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "all README python blocks ran" in proc.stdout
    # the sequence-parallel block prints its error against the single-device op
    m = re.search(r"8 devices, max error ([0-9.e+-]+)", proc.stdout)
    assert m and float(m.group(1)) < 1e-5, proc.stdout[-2000:]


def test_not_run_python_blocks_compile():
    for b in BLOCKS:
        if b.lang == "python" and b.not_run is not None:
            compile(b.code, f"README.md:{b.line}", "exec")


def test_bash_blocks_run(tmp_path):
    blocks = [b for b in BLOCKS if b.lang == "bash" and b.not_run is None]
    assert blocks
    env = _env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for b in blocks:
        proc = subprocess.run(["bash", "-e", "-c", b.code], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (f"README line {b.line}:\n{b.code}\n"
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


def test_readme_table_header_is_the_demo_report_header():
    from benchmarks.report import markdown

    generated = markdown(_fake_demo_result()).splitlines()
    readme = _demo_section(README.read_text()).splitlines()
    # the "### `demo` — date, cpu (cores, backend, jax)" title has the report's shape
    title = re.escape(generated[0])
    for field in ("2000-01-01 00:00 UTC", "fake cpu", "1", "cpu", "0.0"):
        title = title.replace(re.escape(field), ".+", 1)
    assert re.fullmatch(title, readme[0]), (readme[0], generated[0])
    header = [line for line in generated if line.startswith("| row |")]
    assert len(header) == 1
    i = generated.index(header[0])
    assert header[0] in readme, f"README demo table header differs from the report's:\n{header[0]}"
    j = readme.index(header[0])
    assert readme[j + 1] == generated[i + 1]  # the alignment row


def test_readme_shows_the_committed_demo_result():
    import json

    from benchmarks.report import markdown

    results = ROOT / "benchmarks" / "results"
    committed = (results / "demo.md").read_text()
    assert markdown(json.loads((results / "demo.json").read_text())) == committed
    assert _demo_section(README.read_text()) == committed
