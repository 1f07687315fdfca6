"""One measurement per fresh process, and that process's resident memory.

A benchmark that measures memory (or must keep an out-of-memory error to one side) runs each configuration as
`python <script> --child '<job as JSON>'`: the child does the job and hands its result back with `child_result`
(one tagged line of JSON on stdout, whatever else it prints), the parent reads it with `launch_child`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

RESULT_TAG = "BENCHMARK_CHILD_RESULT "
# glibc's malloc pinned: every block of 64 KiB or more its own mapping, returned to the system when freed, so that the
# resident set follows what is allocated (benchmarks/step_overhead.py, benchmarks/memory_real.py)
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


class ChildFailed(RuntimeError):
    """A child ran past its time, or ended without a result: the message is the tail of what it printed."""


def child_result(result) -> None:
    """In the child: hand `result` (JSON-able) back to the parent."""
    print(RESULT_TAG + json.dumps(result), flush=True)


def launch_child(script: Path, job: dict, env: dict, timeout: float | None = None, cwd: Path | None = None):
    """Run `script --child <job>` in a fresh Python process with environment `env`; the result it handed back."""
    command = [sys.executable, str(script), "--child", json.dumps(job)]
    try:
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        raise ChildFailed(f"timed out after {timeout:.0f} s") from error
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
    raise ChildFailed("\n".join(tail) or f"exited {done.returncode} and printed nothing")


def status_kib(field: str) -> int | None:
    """A memory field of /proc/self/status (VmRSS: resident now; VmHWM: the high-water mark) in KiB; None off Linux."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset this process's high-water mark (VmHWM) to its resident set now (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
