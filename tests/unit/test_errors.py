"""How each kind of failure reaches the user (qlora_fsdp/errors.py, printed by qlora_fsdp.cli.report_failure)."""

from __future__ import annotations

import pytest

from qlora_fsdp.cli import report_failure
from qlora_fsdp.errors import BUG_REPORT, InternalError, TrainingStopped, UserError
from qlora_fsdp.parallel.sharding import PackedWeightsChanged


def _raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:  # a real traceback to print
        return caught


def test_a_users_mistake_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert report_failure(_raised(UserError("--lr must be > 0"))) == 2
    assert capsys.readouterr().err == "error: --lr must be > 0\n"


def test_a_numeric_stop_is_one_line_and_status_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert report_failure(_raised(TrainingStopped("step 4: non-finite loss; try --nan_policy skip"))) == 3
    assert capsys.readouterr().err == "error: step 4: non-finite loss; try --nan_policy skip\n"


def test_a_broken_invariant_shows_its_traceback_and_asks_for_a_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert report_failure(_raised(PackedWeightsChanged("layer 0's bytes changed"))) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "_raised" in err  # the frame that raised it
    assert err.endswith(f"error: layer 0's bytes changed\nerror: {BUG_REPORT}\n")
    assert issubclass(PackedWeightsChanged, InternalError) and not issubclass(PackedWeightsChanged, UserError)


class _Writes:
    """A stderr that keeps each write call apart: what reaches the pipe as one write(2) under PYTHONUNBUFFERED."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_the_error_line_is_one_write_so_ranks_lines_never_run_together(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every rank writes its error line to the same pipe; a line written as text, then newline, can have another
    # rank's line land between the two (CI saw two ranks' lines run into one).
    stderr = _Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    assert report_failure(_raised(UserError("reward function too_few returned 3 rewards"))) == 2
    assert stderr.calls == ["error: reward function too_few returned 3 rewards\n"]


def test_a_bugs_report_is_one_write_so_ranks_tracebacks_stay_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = _Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    assert report_failure(_raised(PackedWeightsChanged("layer 0's bytes changed"))) == 1
    (text,) = stderr.calls
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith(f"error: layer 0's bytes changed\nerror: {BUG_REPORT}\n")
