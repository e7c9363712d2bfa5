"""Wall time of each phase of one command (``fp8onnx -v quantize`` prints them as a table).

Inside a :func:`recording` block, ``lap(name)`` books the time since the previous lap (or the start)
to phase ``name``, and ``with phase(name):`` books the time inside it to a sub-phase of the lap in
progress, shown indented under it. Outside a recording both cost one ``perf_counter`` call at most
and record nothing, so library code can mark its phases unconditionally.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import resource
import sys
import time

__all__ = ["Phases", "current_phases", "lap", "peak_rss_mib", "phase", "process_age", "recording", "table"]

_current: contextvars.ContextVar[Phases | None] = contextvars.ContextVar("fp8onnx_phases", default=None)


class Phases:
    """Seconds per phase (a phase booked twice adds up), each with its depth and first start."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.depth: dict[str, int] = {}
        self.start: dict[str, float] = {}
        self.peak: dict[str, float] = {}  # the process's peak RSS (MiB) when the phase last ended
        self._stack: list[str] = []
        self._last = time.perf_counter()

    def add(self, name: str, seconds: float, depth: int, start: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds
        self.depth.setdefault(name, depth)
        self.start.setdefault(name, start)
        self.peak[name] = peak_rss_mib()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.add(name, now - self._last, 0, self._last)
        self._last = now

    def _ordered(self) -> list[str]:
        return sorted(self.times, key=lambda n: (self.start[n], self.depth[n]))

    def to_json(self) -> list[dict]:
        """``[{"phase", "seconds", "depth", "peak_rss_mib"}]``: laps (depth 0) each followed by its
        sub-phases; ``peak_rss_mib`` is the process's peak so far when the phase ended, so the first
        phase that reaches the final value is the one that set the peak."""
        return [
            {"phase": n, "seconds": round(self.times[n], 4), "depth": self.depth[n], "peak_rss_mib": self.peak[n]}
            for n in self._ordered()
        ]


def table(phases: list[dict], startup: float | None = None) -> str:
    """One line per phase (sub-phases indented under their lap) with its share of the laps' total;
    ``startup``: seconds before the command started (interpreter and imports), shown first."""
    rows = (
        [{"phase": "startup (interpreter and imports)", "seconds": startup, "depth": 0}] if startup else []
    ) + phases
    total = sum(r["seconds"] for r in rows if r["depth"] == 0)
    width = max((len(r["phase"]) + 2 * r["depth"] for r in rows), default=5)
    lines = [f"  {'phase':<{width}}  {'seconds':>8}  {'share':>6}  {'peak RSS so far':>15}"]
    for r in rows:
        label = "  " * r["depth"] + r["phase"]
        share = f"{r['seconds'] / total:6.1%}" if total else "     -"
        peak = f"{r['peak_rss_mib']:11.0f} MiB" if r.get("peak_rss_mib") else ""
        lines.append(f"  {label:<{width}}  {r['seconds']:8.3f}  {share}  {peak:>15}")
    lines.append(f"  {'total':<{width}}  {total:8.3f}")
    return "\n".join(lines)


@contextlib.contextmanager
def recording():
    """Record the phases run inside this block (in this thread/context) into a new :class:`Phases`."""
    phases = Phases()
    token = _current.set(phases)
    try:
        yield phases
    finally:
        _current.reset(token)


def current_phases() -> list[dict]:
    """The phases recorded so far in the current recording ([] outside one)."""
    phases = _current.get()
    return [] if phases is None else phases.to_json()


def lap(name: str) -> None:
    """Book the time since the previous lap to ``name`` (module docstring)."""
    phases = _current.get()
    if phases is not None:
        phases.lap(name)


@contextlib.contextmanager
def phase(name: str):
    """Book the time inside the block to sub-phase ``name`` of the lap in progress."""
    phases = _current.get()
    if phases is None:
        yield
        return
    phases._stack.append(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        phases._stack.pop()
        phases.add(name, time.perf_counter() - start, 1 + len(phases._stack), start)


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, MiB (getrusage; kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), e.g. to show what imports cost; else None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
