"""Generate the Python protobuf and gRPC modules from ``proto/rankwatch/v1``.

    python -m rankwatch.proto.generate          # rewrite the generated files
    python -m rankwatch.proto.generate --check  # exit 1 if they are stale

The generated modules sit beside their ``.proto`` file.  protoc writes the
gRPC module's import of its message module as an absolute ``rankwatch.v1``
import, which would collide with our namespace, so it is made relative.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

__all__ = ["PROTO_ROOT", "generate", "main"]

PROTO_ROOT = Path(__file__).resolve().parent
_PROTO_FILES = ("rankwatch/v1/agent.proto",)
_OUTPUTS = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over the proto files into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # build-time dependency only

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / p) for p in _PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for proto in _PROTO_FILES:
        stem = proto[: -len(".proto")]
        for suffix in _OUTPUTS:
            path = out_dir / f"{stem}{suffix}"
            text = path.read_text()
            text = re.sub(
                r"^from rankwatch\.v1 import (\w+) as", r"from . import \1 as", text, flags=re.M
            )
            path.write_text(text)
            written.append(path)
    return written


def _relative(paths: list[Path], root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in paths}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = _relative(generate(Path(tmp)), Path(tmp))
    stale = [name for name, text in fresh.items() if not (PROTO_ROOT / name).is_file()
             or (PROTO_ROOT / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"stale generated file: proto/{name}", file=sys.stderr)
        return 1 if stale else 0
    for name in stale:
        (PROTO_ROOT / name).write_text(fresh[name])
        print(f"wrote proto/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
