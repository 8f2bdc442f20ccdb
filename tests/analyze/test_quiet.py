"""snip-analyze's output is its own: inside `held_output` the loop's prints, logs and warnings are
held while SNIP's lines pass; an unexpected failure shows the last held lines on stderr, bad input
(a ValueError, one line) shows none; `-v` (verbose) holds nothing."""

import logging
import sys
import warnings

import pytest

from snip_megatron.analyze.quiet import SHOWN, held_output


def loop_output(lines: int = 3) -> None:
    """What a loop prints while it loads: its own lines, SNIP's, a log record, a warning."""
    print("------------------------ arguments ------------------------")
    for i in range(lines):
        print(f"  arg_{i} .... {i}")
    print("[snip] on; backend emulated")
    sys.stderr.write("torch distributed is already initialized\n")
    logging.getLogger("megatron.core.rerun_state_machine").warning("RerunStateMachine initialized")
    warnings.warn("full scope is deprecated", UserWarning)


def test_only_snips_lines_pass_and_nothing_is_held_after(capsys, caplog):
    with held_output():
        loop_output()
    print("[snip-analyze] the table")
    out, err = capsys.readouterr()
    assert out == "[snip] on; backend emulated\n[snip-analyze] the table\n" and err == ""
    assert caplog.records == []  # no record of the loop's was even made
    logging.getLogger("megatron").warning("after the analysis")  # logging is back
    assert [r.getMessage() for r in caplog.records] == ["after the analysis"]


def test_an_unexpected_failure_shows_the_last_held_lines_and_bad_input_none(capsys):
    with pytest.raises(RuntimeError), held_output():
        loop_output(lines=SHOWN + 10)
        raise RuntimeError("the loop failed")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"[snip-analyze] the loop's output before it stopped (its last {SHOWN} lines; -v shows all):"
    assert err[-1] == "torch distributed is already initialized" and len(err) == SHOWN + 1
    assert "------------------------ arguments ------------------------" not in err  # the earliest are cut
    with pytest.raises(ValueError), held_output():
        loop_output()
        raise ValueError("--load x: no such checkpoint folder")
    assert capsys.readouterr() == ("[snip] on; backend emulated\n", "")


def test_verbose_holds_nothing(capsys):
    with held_output(verbose=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop_output()
    out, err = capsys.readouterr()
    assert "------------------------ arguments ------------------------" in out and "  arg_2 .... 2" in out
    assert "torch distributed is already initialized" in err
