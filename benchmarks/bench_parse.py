"""Parse speed (MB/s) and memory of the HLO parser on real compiled HLO.

Usage: python benchmarks/bench_parse.py [HLO files...]

Without arguments it compiles the default experiment (72 fake devices) and parses its
post-SPMD module and its final optimised module, plus the largest reference dumps.
"""

from __future__ import annotations

import os
import sys
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def default_texts() -> list[tuple[str, str]]:
    import models
    import sharding
    from experiments import config

    exp = config.load(ROOT / "experiments/configs/llama3-8b-nvl72.toml")
    sharding.ensure_cpu_devices(exp.system.num_devices)
    mesh = sharding.make_mesh(exp.system, exp.parallelism.sizes())
    prog = models.build_train_program(exp.model, mesh, exp.parallelism.axis_rules(),
                                      workload=exp.workload, precision=exp.precision,
                                      train=exp.train)
    import jax

    with jax.set_mesh(mesh):
        c = sharding.compile_to_hlo(prog.step, *prog.args)
    texts = [("llama3-8b-nvl72 post-SPMD", c.hlo_text),
             ("llama3-8b-nvl72 final XLA:CPU", c.compiled.as_text())]
    ref = ROOT.parent / "shared" / "reference" / "hlo"
    for name in ("train_step.tpu7x.hlo", "train_step.gpu-h100.hlo"):
        if (ref / name).exists():
            texts.append((name, (ref / name).read_text()))
    return texts


def main() -> int:
    from sharding.collectives import extract_collectives
    from sharding.hlo import parse_hlo

    if len(sys.argv) > 1:
        texts = [(p, Path(p).read_text()) for p in sys.argv[1:]]
    else:
        texts = default_texts()
    print(f"{'module':<34}{'MB':>7}{'parse':>9}{'MB/s':>8}{'+collectives':>14}{'peak MiB':>10}")
    for name, text in texts:
        mb = len(text.encode()) / 1e6
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            module = parse_hlo(text)
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        extract_collectives(module)
        coll = time.perf_counter() - t0
        tracemalloc.start()
        parse_hlo(text)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        print(f"{name[:33]:<34}{mb:>7.2f}{best:>8.3f}s{mb / best:>8.1f}{coll:>13.3f}s{peak:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
