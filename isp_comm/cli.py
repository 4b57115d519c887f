"""``isp-comm``: maintenance commands.

isp-comm cleanup [--dry-run]   remove shared-memory segments left by dead isp-comm jobs
"""

from __future__ import annotations

import argparse
import sys

from isp_comm.backends.shm import Segment, stale_segments


def parser() -> argparse.ArgumentParser:
    """isp-comm's subcommands and their arguments."""
    ap = argparse.ArgumentParser(prog="isp-comm", description="isp-comm maintenance commands")
    sub = ap.add_subparsers(dest="command", required=True)
    clean = sub.add_parser("cleanup", help="remove shared-memory segments whose creating process is gone")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "cleanup":
        names = stale_segments()
        for name in names:
            if not args.dry_run:
                Segment.unlink(name)
            print(("would remove " if args.dry_run else "removed ") + name)
        if not names:
            print("no stale isp-comm segments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
