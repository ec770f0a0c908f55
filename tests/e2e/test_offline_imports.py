"""Offline planning never loads torch: ``Plan``, ``estimate``, ``search`` and ``autopar plan``,
each checked in a fresh interpreter (docs/architecture.md).  Also: importing the search's
module leaves ``autopar.search`` the function.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

OFFLINE = ("import autopar, autopar.cost; from autopar import search, estimate, Plan; "
           "from autopar.planning.search import enumerate_plans; import sys; "
           "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]; "
           "assert callable(autopar.search), autopar.search; print('ok')")


@pytest.mark.parametrize("code", [
    OFFLINE,
    "import sys; from autopar.cli import main; main(['plan', '--model', 'llama3-8b', '--gpu', 'h100', '--gpus', "
    "'16', '--seq', '4096', '--global-batch', '32', '--top', '1']); assert 'torch' not in sys.modules; print('ok')",
    "import sys; from autopar.cli import main; main(['explain', '--model', 'llama3-8b', '--plan', 'tp=8,dp=2', "
    "'--gpu', 'h100', '--gpus', '16', '--seq', '4096', '--global-batch', '32']); "
    "assert 'torch' not in sys.modules; print('ok')",
], ids=["api", "plan", "explain"])
def test_offline_planning_imports_no_torch(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
