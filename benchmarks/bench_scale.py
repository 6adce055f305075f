"""Runs past one compile: the wall time of `shardscope run` on 16,384 and 100,000 GPUs and a
9,216-chip TPU7x pod (goal: under 2 minutes each on 2 cores), each compiled with a few
data-parallel replicas and read as the full run (sharding/extrapolate.py).

Usage: python benchmarks/bench_scale.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("llama3-405b-h100-16384-tp8-pp16-dp128", "llama3-70b-gb200-100k-tp4-pp8",
           "llama3-405b-tpu7x-9216-tp8-pp8")


def main() -> int:
    for name in CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "experiments.cli", "run", name, "--quiet",
                                "--json", out], cwd=REPO, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode:
                print(f"{name}: failed: {p.stderr.strip().splitlines()[-1]}")
                return 1
            d = json.loads(open(out).read())
        print(f"{name}: {d['num_devices']:,} devices in {wall:.0f} s (goal < 120 s); step "
              f"{d['step_time_s']:.3f} s, MFU {d['mfu']:.1%}; {d['extrapolated_from']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
