"""Progress of a model load: a tqdm bar on a terminal; otherwise log lines (a service's log is not a terminal),
one every `every_s` seconds and one at the end, so a slow load of a large checkpoint is visibly moving."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Self

from tqdm import tqdm

log = logging.getLogger("tpuserve.model.loader")


class LoadProgress:
    def __init__(
        self, desc: str, total: int | None = None, unit: str = "tensor", every_s: float = 5.0
    ) -> None:
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.count = 0
        self._bar = tqdm(desc=desc, total=total, unit=unit) if sys.stderr.isatty() else None
        self._start = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            log.info("%s: %s %ss (%.0f s)", self.desc, self._counted(), self.unit, now - self._start)

    def _counted(self) -> str:
        return f"{self.count}/{self.total}" if self.total else str(self.count)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        if self._bar is not None:
            self._bar.close()
        elif exc_type is None:
            log.info(
                "%s: %s %ss in %.1f s", self.desc, self._counted(), self.unit, time.monotonic() - self._start
            )
