"""``python -m graphattn demo``, the README's first command: it runs and reports, and bad
arguments stop it with a usage error before any engine is built."""

from __future__ import annotations

import pytest

from graphattn.__main__ import main


def test_demo_runs_reports_and_sums_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHATTN_CACHE_DIR", str(tmp_path))
    assert main(["demo", "--cpu", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "cudagraph mode: requested FULL_AND_PIECEWISE -> resolved NONE" in out
    assert "8 prompts x 2 new tokens on cpu" in out
    assert "fallback: cudagraph_mode FULL_AND_PIECEWISE -> NONE" in out  # said, not silent


def test_demo_runs_the_mla_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHATTN_CACHE_DIR", str(tmp_path))
    assert main(["demo", "--cpu", "--new-tokens", "2", "--model", "mla"]) == 0
    out = capsys.readouterr().out
    assert "TORCH_REF_MLA" in out and "mla(latent=64, rope=16, heads=8, float32)" in out
    assert "8 prompts x 2 new tokens on cpu" in out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--modes", "BOGUS"], "argument --modes: expected comma-separated modes among NONE,"),
        (["--modes", "full"], "got 'full'"),
        (["--new-tokens", "0"], "argument --new-tokens: expected an int >= 1, got '0'"),
        (["--new-tokens", "many"], "expected an int >= 1, got 'many'"),
        (["--model", "gpt"], "argument --model: invalid choice: 'gpt'"),
    ],
)
def test_demo_refuses_bad_arguments_at_once(arguments, message, capsys):
    """Before, a bad mode or token count built an engine, printed its report and then ended
    in a traceback."""
    with pytest.raises(SystemExit) as stop:
        main(["demo", *arguments])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
