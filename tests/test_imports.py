"""Import hygiene: ``import dilax`` (the functional ops) loads no Flax; the Flax parts
(``dilax.create_attention``, :mod:`dilax.nn`, :mod:`dilax.models`, :mod:`dilax.train`) load it
when they are used. Each check runs in a fresh interpreter: this one has imported flax already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> dict:
    """Runs ``code`` in a new interpreter on this checkout; returns the JSON it prints last."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_FLAX = "[m for m in sys.modules if m == 'flax' or m.startswith('flax.')]"


def test_import_dilax_loads_no_flax():
    got = _fresh(f"""
import io, json, sys
import dilax
after_import = {_FLAX}
dilax.describe(io.StringIO())
after_describe = {_FLAX}
print(json.dumps(dict(file=dilax.__file__, after_import=after_import,
                      after_describe=after_describe, nn_loaded='dilax.nn' in sys.modules,
                      listed='create_attention' in dir(dilax))))
""")
    assert Path(got["file"]).resolve().is_relative_to(REPO), got["file"]
    assert got["after_import"] == [], got["after_import"]
    assert got["after_describe"] == [], got["after_describe"]
    assert not got["nn_loaded"]
    assert got["listed"]


def test_create_attention_is_imported_on_first_use():
    got = _fresh(f"""
import json, sys
from dilax import create_attention
import dilax
att = dilax.create_attention(segment_lengths=(8,), dilation_rates=(1,))
print(json.dumps(dict(same=create_attention is dilax.create_attention
                      is sys.modules['dilax.factory'].create_attention,
                      kind=att.choice.kind, flax=bool({_FLAX}))))
""")
    assert got == {"same": True, "kind": "dilated", "flax": True}
