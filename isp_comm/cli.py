"""``isp-comm``: maintenance commands.

isp-comm cleanup [--dry-run]   remove shared-memory segments left by dead isp-comm jobs
isp-comm doctor [--live] RUN   a run folder's hang diagnosis, or where a live job's ranks are now
"""

from __future__ import annotations

import argparse
import sys

from isp_comm.backends.shm import Segment, stale_segments
from isp_comm.flight import doctor


def parser() -> argparse.ArgumentParser:
    """isp-comm's subcommands and their arguments."""
    ap = argparse.ArgumentParser(prog="isp-comm", description="isp-comm maintenance commands")
    sub = ap.add_subparsers(dest="command", required=True)
    clean = sub.add_parser("cleanup", help="remove shared-memory segments whose creating process is gone")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    doc = sub.add_parser("doctor", help="print a run folder's hang diagnosis (hang.json)")
    doc.add_argument("run", help="the run folder (isp-train's --out, or ISPConfig.diagnosis_dir)")
    doc.add_argument("--live", action="store_true", help="ask the running job where each rank is now")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "doctor":
        try:
            print(doctor.live(args.run) if args.live else doctor.show(args.run))
        except ValueError as exc:
            print(f"isp-comm doctor: {exc}", file=sys.stderr)
            return 2
        return 0
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
