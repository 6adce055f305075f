"""`shardscope search` figures: configs compiled per minute, the wall time of a 48-config
search, and the cost of re-estimating a stored config without compiling.

Usage: python benchmarks/bench_search.py [--workers N] [--budget 48]

The search: Llama 2 7B (MaxText's A3 recipe) on 64 H100s, every data x fsdp x tensor
assignment crossed with two remat policies, the first 48 in the search's own order.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--budget", type=int, default=48)
    args = ap.parse_args()

    from experiments import search
    from experiments.config import BUNDLED, apply_override, read_toml
    from experiments.store import Store

    raw = read_toml(BUNDLED / "maxtext-a3-llama2-7b.toml", what="config", example="")
    for item in ("system.name=h100:64", "workload.global_batch=256"):
        apply_override(raw, item)
    with tempfile.TemporaryDirectory() as tmp, Store(os.path.join(tmp, "s.sqlite")) as store:
        t0 = time.perf_counter()
        out = search.run_search(raw, num_devices=64, axes=("data", "fsdp", "tensor"),
                                vary=[("train.remat", ["minimal", "full"])], store=store,
                                search=raw["name"], workers=args.workers,
                                budget=args.budget)
        wall = time.perf_counter() - t0
        results = store.results()
        ran = [r for r in results if r.status == "ok"]
        tried = [r for r in results if r.message != "" or r.status == "ok"]
        compiles = [r.timings.get("compile_s", 0.0) for r in ran]
        print(f"search: {len(results)} configs ({len(ran)} compiled and estimated, "
              f"{sum(r.status == 'refused' for r in results)} refused or pruned, "
              f"{sum(r.status == 'error' for r in results)} failed) in {wall:.0f} s with "
              f"{args.workers} workers: {60 * len(tried) / wall:.1f} configs per minute; "
              f"compile {sum(compiles) / max(len(compiles), 1):.1f} s mean")
        t1 = time.perf_counter()
        again = search.reestimate(store, search=raw["name"])
        per = (time.perf_counter() - t1) / max(sum(r.status == "ok" for r in again), 1)
        print(f"re-estimate without compiling: {1e3 * per:.0f} ms per stored config "
              f"(time its stored plan, write the new figures; goal 10 ms)")
        best = search.ranking(results)
        if best:
            print(f"best: {best[0].name} {best[0].step_time_s:.3f} s, MFU {best[0].mfu:.1%}")
    return 0 if out.compiled else 1


if __name__ == "__main__":
    sys.exit(main())
