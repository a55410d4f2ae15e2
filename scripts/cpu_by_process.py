"""CPU seconds each process on the machine used while a command ran, with the busiest threads of
the busiest processes: where a served load's CPU went (the worker's compute threads, its other
threads, the router, Ray's daemons), beside the command's own.

    python scripts/cpu_by_process.py -- cachesvc bench serve --url http://127.0.0.1:8000 ...

Reads /proc only (Linux). Processes that started and ended within the run are not seen, except
the command itself, whose own CPU is printed from its exit status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

_HZ = os.sysconf("SC_CLK_TCK")
_SHOWN_PROCESSES = 12
_SHOWN_THREADS = 6
_MIN_S = 0.05  # less than this is left out


@dataclass(frozen=True)
class Usage:
    name: str
    cpu_s: float


def _stat(path: str) -> Usage:
    with open(path) as f:
        text = f.read()
    close = text.rindex(")")
    fields = text[close + 2 :].split()
    return Usage(text[text.index("(") + 1 : close], (int(fields[11]) + int(fields[12])) / _HZ)


def _command_line(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]


def snapshot() -> dict[str, tuple[Usage, str, dict[str, Usage]]]:
    """Every process's usage, command line and threads' usage, by pid."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            threads = {
                tid: _stat(f"/proc/{pid}/task/{tid}/stat")
                for tid in os.listdir(f"/proc/{pid}/task")
            }
            out[pid] = (_stat(f"/proc/{pid}/stat"), _command_line(pid), threads)
        except OSError:  # it ended meanwhile
            continue
    return out


def report(before: dict, after: dict) -> list[str]:
    """The lines of the table: each process's CPU seconds between the snapshots."""
    rows = []
    for pid, (usage, cmd, threads) in after.items():
        was = before.get(pid)
        spent = usage.cpu_s - (was[0].cpu_s if was else 0.0)
        if spent >= _MIN_S:
            rows.append((spent, pid, usage.name, cmd, threads, was[2] if was else {}))
    rows.sort(key=lambda row: row[0], reverse=True)
    lines = [f"all processes seen: {sum(row[0] for row in rows):.2f} s"]
    for spent, pid, name, cmd, threads, threads_before in rows[:_SHOWN_PROCESSES]:
        lines.append(f"{spent:8.2f} s  pid {pid:>7}  {name:16} {cmd}")
        if spent < 1.0:
            continue
        by_thread = sorted(
            (
                (t.cpu_s - threads_before.get(tid, Usage(t.name, 0.0)).cpu_s, t.name)
                for tid, t in threads.items()
            ),
            reverse=True,
        )
        for thread_s, thread in by_thread[:_SHOWN_THREADS]:
            if thread_s >= _MIN_S:
                lines.append(f"{'':12}{thread_s:8.2f} s  thread {thread}")
    return lines


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    before, start = snapshot(), time.monotonic()
    child = subprocess.Popen(command)
    _, status, own = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage
    wall = time.monotonic() - start
    after = snapshot()
    print(f"wall {wall:.2f} s; the command itself: {own.ru_utime + own.ru_stime:.2f} s of CPU")
    print("\n".join(report(before, after)))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
