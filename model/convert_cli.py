"""`tpuserve convert SRC DST`: write an Orbax checkpoint (+ config and tokenizer files) and compare load times."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from tpuserve.model.loader import convert, load_model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpuserve convert", description=__doc__)
    p.add_argument("src", help="GGUF file or Hugging Face directory ('embedded' for the default model)")
    p.add_argument("dst", help="output directory")
    args = p.parse_args(argv)
    src = None if args.src == "embedded" else args.src
    start = time.perf_counter()
    loaded = convert(src, args.dst)
    print(f"converted {loaded.source} -> {args.dst} in {time.perf_counter() - start:.1f} s "
          f"(source load {loaded.load_seconds:.2f} s)")  # fmt: skip
    again = load_model(args.dst)
    print(f"load time: source {loaded.load_seconds:.2f} s, Orbax {again.load_seconds:.2f} s "
          f"({loaded.load_seconds / again.load_seconds:.1f}x faster)")  # fmt: skip
    return 0
