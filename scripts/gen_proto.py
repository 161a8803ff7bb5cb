#!/usr/bin/env python3
"""Regenerates psframe/wire/psframe_pb2.py(i) from psframe/wire/psframe.proto.

Usage: python scripts/gen_proto.py [--out DIR]

The generated files are checked in; tests/unit/test_proto.py runs this script into
a temporary folder and fails if the result differs from what is committed.
No *_pb2_grpc.py is generated: psframe registers its gRPC methods itself, with
the codec's zero-copy serializers, from the service described in the .proto.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "psframe" / "wire"


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # needs the `test` extra: grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(PROTO_DIR / "psframe.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on psframe.proto")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder")
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
