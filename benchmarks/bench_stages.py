"""Time each stage of `shardscope run` for an experiment and print the figures.

Usage: python benchmarks/bench_stages.py CONFIG.toml [--repeat N]

The work after compile (parse + estimate) should stay under 10% of the compile time.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from experiments import config, runner

    exp = config.load(args.config)
    import sharding

    sharding.ensure_cpu_devices(exp.system.num_devices)
    print(f"experiment {exp.name} on {exp.system.name}")
    print(f"{'run':>4} {'build':>8} {'lower':>8} {'compile':>8} {'parse':>8} {'estimate':>9}"
          f" {'after/compile':>14} {'wall':>8}")
    for i in range(args.repeat):
        t0 = time.perf_counter()
        rep = runner.run(exp, backend="cpu")
        wall = time.perf_counter() - t0
        t = rep.timings
        ratio = (t["parse_s"] + t.get("read_s", 0) + t["estimate_s"]) / t["compile_s"]
        print(f"{i:>4} {t['build_s']:>7.3f}s {t['lower_s']:>7.3f}s {t['compile_s']:>7.3f}s "
              f"{t['parse_s']:>7.3f}s {t.get('read_s', 0) + t['estimate_s']:>8.3f}s "
              f"{ratio:>13.2%} {wall:>7.2f}s")
    # The compile with LLVM's full optimisation, which the analysis does not need
    # (sharding.compiler.CPU_ANALYSIS_OPTIONS skip it; the report is the same).
    import sharding.api

    real = sharding.api.compile_to_hlo
    sharding.api.compile_to_hlo = lambda *a, **k: real(*a, fast_cpu=False, **k)
    slow = runner.run(exp, backend="cpu")
    sharding.api.compile_to_hlo = real
    same = slow.step_time_s == rep.step_time_s
    print(f"compile with LLVM's full optimisation {slow.timings['compile_s']:.3f}s against "
          f"{rep.timings['compile_s']:.3f}s without it "
          f"({1 - rep.timings['compile_s'] / slow.timings['compile_s']:.0%} less; same "
          f"estimate: {same})")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MiB; {len(rep.collectives)} collectives; "
          f"estimated step {rep.step_time_s:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
