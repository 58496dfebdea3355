"""``python -m cube.onnx ops``: the supported operators as a markdown table;
``python -m cube.onnx check FILE``: whether cube imports a file, and its parameters."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cube.onnx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="print the table of supported ONNX operators (markdown)")
    check = sub.add_parser("check", help="import an ONNX file and print its inputs and parameters")
    check.add_argument("file")
    args = parser.parse_args(argv)
    import cube.onnx
    if args.command == "ops":
        print(cube.onnx.ops_table())
        return 0
    try:
        module = cube.onnx.load(args.file)
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 1
    params = sum(p.numel() for p in module.parameters())
    print(f"{args.file}: inputs {list(module.onnx_inputs)}, outputs {list(module.onnx_outputs)}, "
          f"{params:,} parameters in {len(list(module.parameters()))} tensors, "
          f"{len(list(module.buffers()))} buffers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
