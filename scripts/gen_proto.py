"""Compile ``proto/fairway/v1/admin.proto`` into ``picker/admin/v1`` (``make proto``).

grpcio-tools names the generated modules after the proto's path (``fairway.v1``); the picker
imports them as ``picker.admin.v1``, so the one cross-module import is rewritten. The output is
committed; ``tests/unit/test_admin_proto.py`` checks it matches the proto.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO = "fairway/v1/admin.proto"
OUT = ROOT / "picker" / "admin" / "v1"
FILES = ("admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py")


def generate() -> dict[str, str]:
    """The generated files' contents, by name."""
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        code = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}",
                            f"--python_out={tmp}", f"--pyi_out={tmp}",
                            f"--grpc_python_out={tmp}", str(ROOT / "proto" / PROTO)])
        if code != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit {code})")
        built = Path(tmp) / "fairway" / "v1"
        return {name: (built / name).read_text().replace("from fairway.v1 import",
                                                         "from picker.admin.v1 import")
                for name in FILES}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(str(OUT / n) for n in FILES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
