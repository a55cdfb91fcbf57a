"""Regenerate the committed gRPC code from the .proto files in this folder.

    python protos/generate.py          # rewrite protos/*_pb2*.py(i) for every .proto here
                                       # (stage.proto, authorizer.proto)
    python protos/generate.py --check  # exit 1 if regeneration would change them

Why a temporary tree: protoc derives the generated imports from the path of the .proto under
its include root. Compiling `agora/protos/stage.proto` from a scratch root makes grpc_tools
write `from agora.protos import stage_pb2`, the installed import path, instead of a bare
`import stage_pb2` that only works with protos/ on sys.path. The committed files are therefore
exactly what `generate()` returns, and tests/integration/test_protos.py fails when they drift.

Needs grpcio-tools (the `test` extra); the runtime only needs protobuf and grpcio.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["PROTO_DIR", "PACKAGE_PATH", "generate", "write", "stale_files"]

PROTO_DIR = Path(__file__).resolve().parent
# Where the .proto files sit in the scratch tree: the import path of the generated modules.
PACKAGE_PATH = Path("agora") / "protos"


def generate(proto_dir: Path = PROTO_DIR) -> dict[str, str]:
    """Generated file name -> text, for every .proto in `proto_dir`."""
    from grpc_tools import protoc  # the test extra; imported here so the package never needs it

    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {proto_dir}")
    with tempfile.TemporaryDirectory(prefix="agora-protos-") as scratch:
        root = Path(scratch) / "src"
        out = Path(scratch) / "out"
        (root / PACKAGE_PATH).mkdir(parents=True)
        out.mkdir()
        for proto in protos:
            shutil.copyfile(proto, root / PACKAGE_PATH / proto.name)
        # grpc_tools ships the well-known types (google/protobuf/*.proto) as package data.
        well_known = Path(protoc.__file__).resolve().parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *[str(PACKAGE_PATH / proto.name) for proto in protos],
        ]
        # protoc resolves the relative .proto names against -I roots, so run from the root.
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} (arguments: {args[1:]})")
        generated = sorted((out / PACKAGE_PATH).iterdir())
        return {path.name: path.read_text() for path in generated if path.is_file()}


def stale_files(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Names of generated files that are missing or differ from a fresh generation."""
    stale = []
    for name, text in generate(proto_dir).items():
        committed = proto_dir / name
        if not committed.exists() or committed.read_text() != text:
            stale.append(name)
    return stale


def write(proto_dir: Path = PROTO_DIR) -> list[str]:
    """Regenerate into `proto_dir`; returns the names written."""
    files = generate(proto_dir)
    for name, text in files.items():
        (proto_dir / name).write_text(text)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether regeneration would change files")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code in {PROTO_DIR}: {', '.join(stale)}; run python protos/generate.py")
            return 1
        print("generated code is up to date")
        return 0
    for name in write():
        print(f"wrote {PROTO_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
