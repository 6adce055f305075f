"""The cost of `shardscope measure`'s own work: reading back the profiler's trace, per
profiled step (the Perfetto JSON parsed, each event put in its category from the executed
program's HLO), beside the step it profiles.

Usage: python benchmarks/bench_measure.py [CONFIG] [--steps N]

Runs the bundled tiny config (data 2 x tensor 4, 8 fake CPU devices) for N steps under
jax.profiler, then times sharding/profile.py on the trace it wrote (best of 3).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?", default="tiny-h100-dp-tp")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()

    import jax

    import sharding
    from experiments import config, runner
    from sharding.profile import profile_by_category, read_events, trace_file

    exp = config.load(a.config)
    sharding.ensure_cpu_devices(exp.system.num_devices)
    mesh = sharding.make_mesh(exp.system, exp.parallelism.sizes())
    program = runner.build_step(exp, mesh, quiet=True).program
    compiled = program.step.lower(*program.args).compile()
    params, opt, batch = program.init(0)
    params, opt, _ = jax.block_until_ready(compiled(params, opt, batch))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(a.steps):
                params, opt, _ = jax.block_until_ready(compiled(params, opt, batch))
        traced = (time.perf_counter() - t0) / a.steps
        path = trace_file(d)
        hlo = compiled.as_text()
        best_read = best_cat = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            events = read_events(path)
            t1 = time.perf_counter()
            prof = profile_by_category(events, hlo, steps=a.steps)
            t2 = time.perf_counter()
            best_read, best_cat = min(best_read, t1 - t0), min(best_cat, t2 - t1)
        size = path.stat().st_size
    per = (best_read + best_cat) / a.steps
    print(f"{exp.name}: {a.steps} profiled steps on {exp.system.num_devices} fake CPU "
          f"devices, {prof.events} instruction events, trace {size / 1e6:.2f} MB (gzip)")
    print(f"  step under the profiler   {traced * 1e3:8.1f} ms")
    print(f"  trace read (JSON)         {best_read / a.steps * 1e3:8.1f} ms per step")
    print(f"  categories (HLO + sum)    {best_cat / a.steps * 1e3:8.1f} ms per step")
    print(f"  trace parse per step      {per * 1e3:8.1f} ms ({per / traced:.0%} of the step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
