"""``python -m mla_rs precompile [--arch sm_80,sm_90a] [--deny-spills]``: build every GPU kernel
ahead of time into the disk cache, as the ``mla precompile`` command does, and print one line a
kernel. Without ``--arch`` it builds for CUDA device 0; with it, for the named architectures,
without a device."""

import argparse
import sys

from . import precompile


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_rs")
    sub = parser.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("precompile", help="build every GPU kernel into the disk cache")
    pre.add_argument("--arch", default="", help="architectures without a device, e.g. sm_80,sm_90a")
    pre.add_argument(
        "--deny-spills",
        action="store_true",
        help="compile afresh and fail when a kernel spills registers",
    )
    args = parser.parse_args(argv)
    arches = [a for a in args.arch.split(",") if a]
    try:
        builds = precompile(arches, use_cache=not args.deny_spills)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    spilled = 0
    for arch, kernel, defines, regs, spills, cached in builds:
        spilled += bool(spills)
        source = "cache" if cached else "nvrtc"
        regs_s = "-" if regs is None else str(regs)
        spills_s = "-" if spills is None else str(spills)
        print(f"{arch:<8} {kernel:<22} {regs_s:>5} {spills_s:>6} {source:>6}  {defines}")
    print(f"{len(builds)} kernels built, {spilled} with spills")
    return 1 if args.deny_spills and spilled else 0


if __name__ == "__main__":
    sys.exit(main())
