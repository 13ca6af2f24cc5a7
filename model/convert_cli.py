"""`tpuserve convert SRC DST [--quantization int8]`: write an Orbax checkpoint (+ config and tokenizer files) and
compare load times; with --quantization int8 the matrices are stored as int8 per output channel."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from tpuserve.model.config import ModelLoadError
from tpuserve.model.loader import convert, load_model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tpuserve convert", description=__doc__)
    p.add_argument("src", help="GGUF file or Hugging Face directory ('embedded' for the default model)")
    p.add_argument("dst", help="output directory")
    p.add_argument("--quantization", choices=("none", "int8"), default="none",
                   help="int8: weight-only, per output channel (default none: float32)")  # fmt: skip
    args = p.parse_args(argv)
    src = None if args.src == "embedded" else args.src
    start = time.perf_counter()
    try:
        loaded = convert(src, args.dst, quantization=args.quantization)
    except ModelLoadError as e:
        p.exit(2, f"tpuserve convert: {e}\n")
    print(f"converted {loaded.source} -> {args.dst} ({loaded.quantization}, {loaded.weight_bytes / 2**20:.1f} MiB of "
          f"weights) in {time.perf_counter() - start:.1f} s (source load {loaded.load_seconds:.2f} s)")  # fmt: skip
    again = load_model(args.dst)
    print(f"load time: source {loaded.load_seconds:.2f} s, Orbax {again.load_seconds:.2f} s "
          f"({loaded.load_seconds / again.load_seconds:.1f}x faster)")  # fmt: skip
    return 0
