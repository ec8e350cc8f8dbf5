"""Generate jaxdist/proto/*_pb2*.py from jaxdist/proto/jaxdist.proto.

This is the only way the generated files are made; never edit them by hand.

    python scripts/gen_proto.py            # regenerate in place
    python scripts/gen_proto.py --check    # exit 1 if the committed files are stale

Needs grpcio-tools (in the ``test`` extra).
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "jaxdist/proto/jaxdist.proto"
OUTPUTS = ("jaxdist_pb2.py", "jaxdist_pb2.pyi", "jaxdist_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc  # imported here: only this script needs grpcio-tools

    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed files")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        made = pathlib.Path(tmp) / "jaxdist" / "proto"
        target = ROOT / "jaxdist" / "proto"
        stale = [n for n in OUTPUTS if not (target / n).exists()
                 or not filecmp.cmp(made / n, target / n, shallow=False)]
        if opts.check:
            for name in stale:
                print(f"stale: jaxdist/proto/{name} (run python scripts/gen_proto.py)")
            return 1 if stale else 0
        for name in OUTPUTS:
            shutil.copyfile(made / name, target / name)
        print(f"generated {', '.join(OUTPUTS)} in jaxdist/proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
