"""The test process's live child processes, read from /proc (Linux): what a test that
starts processes (ranks, busy spinners) checks it left nothing running."""

import os

TRACKER = "multiprocessing.resource_tracker"      # Python's own helper, one per interpreter


def children():
    """[(pid, command line)] of this process's live children, Python's resource tracker aside."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append((int(entry), cmd))
    return [(pid, cmd) for pid, cmd in found if TRACKER not in cmd]
