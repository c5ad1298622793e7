"""The benchmark workers' JSON marks (bench/_train.py): written whole, read back even when two
ranks' lines ran together in the launcher's output."""

from __future__ import annotations

import contextlib
import io
import json

from bench import _train


def test_a_mark_is_one_whole_line() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _train.mark("step", 1, step=51)
    (line,) = out.getvalue().splitlines(keepends=True)
    assert line.startswith(_train.MARK) and line.endswith("\n")
    assert json.loads(line[len(_train.MARK) :])["step"] == 51


def test_marks_run_together_prefixed_or_broken() -> None:
    a = {"event": "step", "time": 2.0, "rank": 0, "step": 51}
    b = {"event": "step", "time": 1.0, "rank": 1, "step": 51}
    text = "\n".join(
        [
            f"[default0]:{_train.MARK}{json.dumps(a)}{_train.MARK}{json.dumps(b)}",
            f'{_train.MARK}{{"event": "step", "ti',  # cut off: skipped
            "step 51 loss 3.2",
        ]
    )
    assert _train.marks(text) == [b, a]  # both, in time order
