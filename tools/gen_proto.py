"""Regenerate the gRPC stubs of minivllm/entrypoints/proto/ from inference.proto (needs grpcio-tools).

    python tools/gen_proto.py          # write the stubs
    python tools/gen_proto.py --check  # exit 1 if the committed stubs differ from freshly generated ones

The stubs are committed so a user needs only the protobuf runtime, not protoc. grpcio-tools' protoc
stamps its version into the stubs, and protobuf refuses a runtime older than that at import, so
pyproject's protobuf lower bound must be at least the version printed here.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = "minivllm/entrypoints/proto"
PROTO = f"{PROTO_DIR}/inference.proto"
STUBS = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")


def generate(out_root: str) -> None:
    """Run protoc from the repository root, so the stubs import each other as minivllm.entrypoints.proto."""
    from grpc_tools import protoc

    os.makedirs(os.path.join(out_root, PROTO_DIR), exist_ok=True)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = protoc.main(["protoc", "-I.", f"--python_out={out_root}", f"--pyi_out={out_root}",
                          f"--grpc_python_out={out_root}", PROTO])
    finally:
        os.chdir(cwd)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    ns = parser.parse_args()
    if not ns.check:
        generate(ROOT)
        print(f"wrote {', '.join(STUBS)} in {PROTO_DIR}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        stale = [s for s in STUBS if not filecmp.cmp(os.path.join(tmp, PROTO_DIR, s),
                                                     os.path.join(ROOT, PROTO_DIR, s), shallow=False)]
    if stale:
        print(f"stale stubs in {PROTO_DIR}: {', '.join(stale)}; run python tools/gen_proto.py", file=sys.stderr)
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
