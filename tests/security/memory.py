"""A process's memory growth over a test, from /proc: its resident set now and its
peak (``VmHWM``), the peak reset at the start (``clear_refs`` 5), so a buffer that
came and went between two looks is still counted."""

from __future__ import annotations

from pathlib import Path

MIB = 1024 * 1024


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class Growth:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.peak_reset = True
        except OSError:  # not ours to reset: only the resident set counts then
            self.peak_reset = False
        self.start_kib = _status_kib(pid, "VmRSS")

    def bytes(self) -> int:
        """The largest growth seen: of the peak (when it was reset), and of now."""
        now = _status_kib(self.pid, "VmRSS")
        peak = _status_kib(self.pid, "VmHWM") if self.peak_reset else now
        return (max(now, peak) - self.start_kib) * 1024
