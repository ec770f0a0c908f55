"""`autopar inspect`: one rank's program, printed in one process without a cluster."""
from __future__ import annotations

import re

import pytest

from autopar.cli import main


def _inspect(capsys, *args) -> str:
    assert main(["inspect", *args]) == 0
    return capsys.readouterr().out


def _marked(out: str, op: str, axis: str = "tp") -> list[str]:
    return [line for line in out.splitlines() if re.search(rf"= {op}\(", line) and f"<<{axis}>>" in line]


def test_tp_sp_program_has_two_gathers_and_two_scatters_per_layer(capsys):
    out = _inspect(capsys, "examples/model.py:build_tiny", "--plan", "tp=2,sp", "--world", "2", "--rank", "0")
    gathers, scatters = _marked(out, "all_gather"), _marked(out, "reduce_scatter")
    for layer in (0, 1):
        assert sum(f"layers.{layer}." in line for line in gathers) == 2
        assert sum(f"layers.{layer}." in line for line in scatters) == 2
    # plus the embedding's reduce-scatter and the gather before the LM head
    assert len(gathers) == 5 and len(scatters) == 5
    assert "all_gather on tp (fwd): 5 in total, 2 per decoder layer x 2 layers + 1 outside the layers" in out
    assert "reduce_scatter on tp (fwd): 5 in total, 2 per decoder layer x 2 layers + 1 outside the layers" in out
    assert "# this rank: rank=0, pp=0, dp=0, cp=0, tp=0" in out
    # every marked line carries the local shape and the predicted bytes
    assert all(" B" in line and "[" in line for line in gathers + scatters)


def test_tp_program_uses_all_reduce(capsys):
    out = _inspect(capsys, "examples/model.py:build_tiny", "--plan", "tp=2", "--world", "2")
    assert len(_marked(out, "all_reduce")) == 2 * 2 + 1  # o/down per layer, embedding
    (loss,) = _marked(out, "vocab_parallel_cross_entropy")
    assert "fwd all_reduce" in loss
    assert len(_marked(out, "region_entry")) == 2 * 2 + 1


def test_rank_coordinates(capsys):
    out = _inspect(capsys, "examples/model.py:build_tiny", "--plan", "tp=2,sp,dp=2", "--world", "4", "--rank", "3")
    assert "# this rank: rank=3, pp=0, dp=1, cp=0, tp=1" in out
    assert "all_reduce on dp (grad)" in out


@pytest.mark.parametrize("args,message", [
    (["examples/model.py:nope", "--plan", "tp=2", "--world", "2"], "has no function 'nope'"),
    (["examples/missing.py:f", "--plan", "tp=2", "--world", "2"], "no such file"),
    (["examples/model.py:build_tiny", "--plan", "tp=2", "--world", "4"], "world"),
    (["examples/model.py:build_tiny", "--plan", "tp=2", "--world", "2", "--rank", "2"], "outside the world"),
])
def test_inspect_errors(capsys, args, message):
    assert main(["inspect", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar:") and message in err
