"""The GPU's clocks and power while a benchmark runs (`nvidia-smi` sampled in the background,
read-only), to tell a slow kernel from a power-capped one (BENCHMARKS.md "MLA decode attention")."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Optional, Sequence

# NVML clocks-event (throttle) reason bits, as nvidia-smi prints them (hex)
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8 | 0x40 | 0x80        # HW slowdown, HW thermal slowdown, HW power brake
SW_THERMAL = 0x20
FIELDS = ("clocks.sm", "power.draw", "clocks_throttle_reasons.active")


def parse_samples(text: str) -> list[tuple[float, float, int]]:
    """(SM MHz, W, throttle bits) per line of `nvidia-smi --format=csv,noheader,nounits` output with
    FIELDS; lines that do not parse (a header, '[N/A]', a cut last line) are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            out.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return out


def summarize(samples: Sequence[tuple[float, float, int]], busy_w: float = 0.0) -> dict:
    """Clock and power statistics of the samples drawing more than busy_w watts (0: all): median and
    lowest SM clock, median and highest power, and the share of samples under each kind of cap."""
    busy = [s for s in samples if s[1] > busy_w]
    if not busy:
        return {"samples": 0}
    sm = [s[0] for s in busy]
    pw = [s[1] for s in busy]
    frac = lambda bits: sum(1 for s in busy if s[2] & bits) / len(busy)
    return {"samples": len(busy), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
            "power_w_median": statistics.median(pw), "power_w_max": max(pw),
            "power_capped": frac(SW_POWER_CAP), "hw_slowdown": frac(HW_SLOWDOWN),
            "thermal_capped": frac(SW_THERMAL)}


BUSY_W = 200.0          # an H200 idles at ~75-160 W: samples above this are the benchmark's


class GpuSampler:
    """Context manager sampling GPU `gpu` every interval_ms; `summary` afterwards ({} without
    nvidia-smi). busy_w: only samples above this draw count (idle gaps would dilute a kernel's
    window)."""

    def __init__(self, interval_ms: int = 50, gpu: int = 0, busy_w: float = BUSY_W,
                 command: Optional[str] = None):
        self.interval_ms, self.gpu, self.busy_w = interval_ms, gpu, busy_w
        self.command = command or shutil.which("nvidia-smi")
        self.summary: dict = {}
        self._proc = None
        self._file = None

    def __enter__(self) -> "GpuSampler":
        if self.command:
            self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
            try:
                self._proc = subprocess.Popen(
                    [
                        self.command,
                        f"--query-gpu={','.join(FIELDS)}",
                        "--format=csv,noheader,nounits",
                        f"--loop-ms={self.interval_ms}",
                        f"--id={self.gpu}",
                    ],
                    stdout=self._file,
                    stderr=subprocess.DEVNULL,
                )
            except OSError:
                self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            self._close()
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._file.flush()
        self._file.seek(0)
        self.summary = summarize(parse_samples(self._file.read()), self.busy_w)
        self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            os.unlink(self._file.name)
            self._file = None


def describe(summary: dict) -> str:
    """'1575 MHz (min 1110), 409 W (max 701), capped 84%' or '-' (no samples)."""
    if not summary.get("samples"):
        return "-"
    return (f"{summary['sm_mhz_median']:.0f} MHz (min {summary['sm_mhz_min']:.0f}), "
            f"{summary['power_w_median']:.0f} W (max {summary['power_w_max']:.0f}), "
            f"capped {100 * summary['power_capped']:.0f}%")
