"""Model-load progress off a terminal (a service's log): a line every few seconds and one at the end."""

from __future__ import annotations

import logging

from tpuserve.model.progress import LoadProgress


def test_log_lines_while_loading_and_at_the_end(caplog):
    with (
        caplog.at_level(logging.INFO, logger="tpuserve.model.loader"),
        LoadProgress("loading big.gguf", total=3, every_s=0.0) as bar,
    ):
        for _ in range(3):
            bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"loading big.gguf: {k}/3 tensors (0 s)" for k in (1, 2, 3)]
    assert lines[3].startswith("loading big.gguf: 3/3 tensors in ")


def test_no_end_line_when_the_load_fails(caplog):
    with caplog.at_level(logging.INFO, logger="tpuserve.model.loader"):
        try:
            with LoadProgress("loading bad.gguf", every_s=60.0) as bar:
                bar.update()
                raise ValueError("corrupt")
        except ValueError:
            pass
    assert caplog.records == []
