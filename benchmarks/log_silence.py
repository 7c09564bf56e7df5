"""Timestamp each line of a command's output and report the longest silence between lines (the figure of issue 41:
a user must tell a slow step from a hung one).

    python benchmarks/log_silence.py -- python examples/hydra_app.py fx_fuse=serving

Prints every line with the seconds since the start, then the longest gaps and the machine's CPU."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import List, Tuple


def cpu_line() -> str:
    """The CPU (model, family and the flags that matter here, as the export records it) and the cores usable."""
    from fx_lightning.common.machine import cpu_info

    return f"CPU: {cpu_info().short()}, {len(os.sched_getaffinity(0))} cores"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--top", type=int, default=5, help="how many of the longest gaps to print")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    start = last = time.monotonic()
    gaps: List[Tuple[float, float, str]] = []  # (gap, at, the line that ended it)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        gaps.append((now - last, now - start, line.rstrip()))
        last = now
        print(f"{now - start:8.2f} {line.rstrip()}", flush=True)
    rc = proc.wait()
    end = time.monotonic()
    gaps.append((end - last, end - start, "<exit>"))
    print(f"\n{len(gaps) - 1} lines in {end - start:.1f} s, exit {rc}; {cpu_line()}")
    for gap, at, line in sorted(gaps, reverse=True)[: args.top]:
        print(f"  silence of {gap:6.2f} s before {at:8.2f}: {line[:120]}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
