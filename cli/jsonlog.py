"""Structured logs: one JSON object per line, standard library only. The command line sets them up before it
runs a process (`tpuserve gateway|grpc|serve`); a layer's `main` run on its own logs plain text.

A record's `extra={"fields": {...}}` is merged into its line; `setup()` makes this the root handler's format."""

from __future__ import annotations

import json
import logging
import sys
import time


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup(level: str | int = "INFO", fmt: str = "json") -> None:
    """Root logging to stderr as JSON lines (`fmt="json"`) or plain text."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # JAX probes every platform it knows at start-up and logs the misses ("Unable to initialize backend 'tpu'",
    # a missing libtpu.so) at INFO/WARNING: noise on a machine without them. Real failures still show.
    for name in ("jax._src.xla_bridge",):
        logging.getLogger(name).setLevel(logging.ERROR)
