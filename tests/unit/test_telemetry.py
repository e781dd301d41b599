"""kimi_jax.tools.telemetry: nvidia-smi's CSV parsed into clock / power statistics, and the background sampler
(a stand-in `nvidia-smi` script prints known samples; CPU machines have none, which gives {})."""
import os
import stat
import sys
import time

import pytest

from kimi_jax.tools import telemetry

LINES = """1980, 155.20, 0x0000000000000000
1575, 690.50, 0x0000000000000004
1110, 701.00, 0x0000000000000004
[N/A], 80.0, 0x0000000000000001
1965, 412.00, 0x0000000000000000
"""


def test_parse_and_summarize_count_power_capped_samples():
    """Unparseable lines ('[N/A]') are skipped; only samples above busy_w count; the capped fraction is
    over those (2 of the 3 busy ones carry the SW power cap bit 0x4)."""
    samples = telemetry.parse_samples(LINES + "1980, 1")          # a cut last line is skipped too
    assert samples == [(1980.0, 155.2, 0), (1575.0, 690.5, 4), (1110.0, 701.0, 4), (1965.0, 412.0, 0)]
    s = telemetry.summarize(samples, busy_w=200)
    assert s["samples"] == 3 and s["sm_mhz_min"] == 1110 and s["sm_mhz_median"] == 1575
    assert s["power_w_max"] == 701.0 and s["power_capped"] == pytest.approx(2 / 3)
    assert s["hw_slowdown"] == 0 and s["thermal_capped"] == 0
    assert telemetry.describe(s) == "1575 MHz (min 1110), 690 W (max 701), capped 67%"
    assert telemetry.summarize(samples, busy_w=800) == {"samples": 0}
    assert telemetry.describe({"samples": 0}) == telemetry.describe({}) == "-"


def test_sampler_runs_nvidia_smi_in_the_background(tmp_path):
    """The sampler starts the command with the query, CSV and loop flags, stops it on exit and summarizes
    what it printed; without the command the summary is {} and the block runs all the same."""
    fake = tmp_path / "nvidia-smi"
    args_file = tmp_path / "args"
    fake.write_text(f"#!{sys.executable}\nimport sys, time\nopen({str(args_file)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
                    f"sys.stdout.write({LINES!r}); sys.stdout.flush()\ntime.sleep(60)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with telemetry.GpuSampler(interval_ms=20, gpu=1, busy_w=200, command=str(fake)) as s:
        for _ in range(200):                              # until the stand-in has printed
            if args_file.exists() and s._file is not None and os.path.getsize(s._file.name) >= len(LINES):
                break
            time.sleep(0.05)
    assert args_file.read_text() == ("--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active "
                                     "--format=csv,noheader,nounits --loop-ms=20 --id=1")
    assert s.summary["samples"] == 3 and s.summary["power_capped"] == pytest.approx(2 / 3)
    with telemetry.GpuSampler(command=str(tmp_path / "missing")) as s2:
        pass
    assert s2.summary == {}
