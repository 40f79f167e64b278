"""Regenerate ppserve/server/gen/ from protos/ppserve/v1/ppserve.proto with grpc_tools.protoc.

    python -m ppserve.server.codegen            # rewrite ppserve/server/gen/ in place
    python -m ppserve.server.codegen --out DIR  # write elsewhere (the freshness test compares)

protoc names modules after the proto's path (`ppserve/v1/ppserve_pb2.py`, imported as
`ppserve.v1.ppserve_pb2`), which would clash with the `ppserve` package itself. So we compile into a
scratch directory, keep the proto's canonical path in the descriptor (reflection reports it), and
rewrite that one import to point into `ppserve.server.gen`. The step is deterministic, so the
committed files must equal a fresh run byte for byte.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILE = "ppserve/v1/ppserve.proto"
GEN_DIR = Path(__file__).resolve().parent / "gen"
GEN_PACKAGE = "ppserve.server.gen"
OUTPUTS = ("ppserve_pb2.py", "ppserve_pb2.pyi", "ppserve_pb2_grpc.py")
INIT_TEXT = (
    '"""Generated protobuf and gRPC modules for ppserve.v1 (by ppserve.server.codegen; do not edit)."""\n'
)


def generate(out_dir: Path) -> list[Path]:
    """Compile the proto into `out_dir` (created if needed); returns the files written."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"  # well-known types shipped with grpc_tools
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO_FILE,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
        produced = Path(tmp) / Path(PROTO_FILE).parent
        written = []
        for name in OUTPUTS:
            text = (produced / name).read_text()
            # The one import protoc writes from the proto path; point it into our package.
            text = text.replace(
                "from ppserve.v1 import ppserve_pb2", f"from {GEN_PACKAGE} import ppserve_pb2"
            )
            dest = out_dir / name
            dest.write_text(text)
            written.append(dest)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GEN_DIR, help=f"output directory (default {GEN_DIR})")
    args = parser.parse_args(argv)
    if args.out.resolve() == GEN_DIR:
        # Start clean so a removed output cannot linger.
        shutil.rmtree(GEN_DIR, ignore_errors=True)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
