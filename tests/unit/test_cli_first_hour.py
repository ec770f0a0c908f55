"""The ``autopar`` command's first-hour frictions, at the argparse level (no tracing, no search).

``--version``; plain-text top-level help; a description on every subcommand; ``explain``'s usage
showing what it requires; ``inspect`` taking ``--world`` from the plan; ``report`` without matplotlib
saying which extra to install; an ``autopar:`` error as one line with exit status 2.
"""
from __future__ import annotations

import sys

import pytest

from autopar import cli
from autopar.cli.inspect_cmd import world_of


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("autopar ") and out.split()[1] in (metadata.version("autopar"), "unknown")


def test_top_level_help_is_plain_text(capsys):
    out = _help(capsys)
    assert "``" not in out and ":func:" not in out
    for command in ("inspect", "plan", "explain", "report", "verify", "calibrate"):
        assert f"    {command}" in out


@pytest.mark.parametrize("command", ["inspect", "plan", "explain", "report", "verify", "calibrate"])
def test_every_command_has_a_description(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse's subparsers action
    assert sub.choices[command].description, command


def test_explain_usage_shows_what_it_requires(capsys):
    usage = _help(capsys, "explain").split("\n\n")[0]
    for flag in ("--plan P", "--model M", "--gpus N", "--seq S", "--global-batch B"):
        assert flag in usage and f"[{flag}" not in usage
    assert "--measure MODULE:FUNCTION --world N" in usage


def test_inspect_world_comes_from_the_plan():
    assert world_of("tp=2,sp,dp=2", None) == 4
    assert world_of("pp=2,tp=2,mb=2", None) == 4
    assert world_of("tp=2", 2) == 2


def test_report_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc = cli.main(["report", "--model", "llama3-8b", "--plan", "tp=8", "--gpus", "8", "--seq", "4096",
                   "--global-batch", "16", "-o", str(tmp_path / "p.html")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("autopar:")
    assert "matplotlib" in err[0] and "autopar[report]" in err[0]
    assert not (tmp_path / "p.html").exists()


def test_an_autopar_error_is_one_line(capsys):
    rc = cli.main(["explain", "--model", "llama3-8b", "--plan", "tp=3", "--gpus", "8", "--seq", "4096",
                   "--global-batch", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("autopar:")
