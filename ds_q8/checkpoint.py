"""Checkpoint conversion commands.

  python -m ds_q8.checkpoint to-universal CKPT/global_step100 CKPT/global_step100_universal
      A DeepSpeed universal checkpoint: resume at any world size with
      "checkpoint": {"load_universal": true} and engine.load_checkpoint(CKPT, tag="global_step100_universal").
      The 8-bit state moves code for code (each parameter's codes and block maxima are kept whole).
  python -m ds_q8.checkpoint to-fp32 CKPT/global_step100 OUT
      The same ZeRO checkpoint with 8-bit state dequantized to fp32 exp_avg/exp_avg_sq (what
      DeepSpeed's own ds_to_universal reads); loadable again at the same world size.
"""
from __future__ import annotations

import argparse
import sys

from .integration.universal import to_fp32_checkpoint, to_universal


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds_q8.checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    u = sub.add_parser("to-universal", help="ZeRO checkpoint tag folder -> universal checkpoint folder")
    u.add_argument("input_folder")
    u.add_argument("output_folder")
    u.add_argument("--keep-fp32", action="store_true", help="keep the intermediate fp32 checkpoint")
    u.add_argument("--workers", type=int, default=1)
    f = sub.add_parser("to-fp32", help="ZeRO checkpoint tag folder -> same with fp32 optimizer state")
    f.add_argument("input_folder")
    f.add_argument("output_folder")
    args = ap.parse_args(argv)
    try:
        if args.command == "to-universal":
            to_universal(args.input_folder, args.output_folder, keep_fp32=args.keep_fp32, workers=args.workers)
        else:
            files = to_fp32_checkpoint(args.input_folder, args.output_folder)
            print(f"wrote {args.output_folder} ({len(files)} optimizer files converted)")
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
