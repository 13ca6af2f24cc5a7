"""Regenerate the committed Python stubs: `python -m tpuserve.proto.generate` (or `make proto`).

The stubs are committed so that the serving install needs no protoc. protoc writes imports relative to the
proto root (`from tpuserve.v1 import ...`); they are rewritten to the installed namespace.
"""

from __future__ import annotations

import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent
PROTOS = sorted((HERE / "tpuserve" / "v1").glob("*.proto"))


def main() -> None:
    import grpc_tools
    from grpc_tools import protoc  # dev-only dependency

    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{HERE}",
        f"-I{include}",
        f"--python_out={HERE}",
        f"--pyi_out={HERE}",
        f"--grpc_python_out={HERE}",
    ] + [str(p.relative_to(HERE)) for p in PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for out in (HERE / "tpuserve" / "v1").glob("*_pb2*.py*"):
        text = out.read_text()
        fixed = re.sub(
            r"^from tpuserve\.v1 import", "from tpuserve.proto.tpuserve.v1 import", text, flags=re.MULTILINE
        )
        out.write_text(fixed)
    print("generated", ", ".join(p.name for p in PROTOS))


if __name__ == "__main__":
    main()
