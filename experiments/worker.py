"""A compile worker: one process that compiles configs of one device count, one at a time.

    python -m experiments.worker DEVICES

It starts JAX once with DEVICES fake CPU devices (set before JAX starts, as a worker of any
other size could not), then reads one JSON request per line on stdin and answers each with
one JSON line on stdout (the protocol: experiments/workers.py). A compiler that aborts or
crashes takes the process with it: the parent records that config's error from the exit
signal and starts a new worker. End of input ends the worker.

For testing the parent's recovery, SHARDSCOPE_FAULT=abort:TEXT makes the worker abort
(SIGABRT, as a failing compiler does) on a config whose name contains TEXT.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time


def _serve(devices: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    core = os.environ.get("SHARDSCOPE_WORKER_CORE", "")  # experiments/workers.py CORE_ENV
    if core and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(core)})
    import jax

    jax.config.update("jax_num_cpu_devices", devices)

    from experiments import config as config_mod
    from experiments import runner
    from experiments.config import ConfigError
    from meshes.calibration import calibration_from_dict

    fault = os.environ.get("SHARDSCOPE_FAULT", "")
    out = os.fdopen(os.dup(1), "w")  # compiles capture fd 2; keep stdout for answers only
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        t0 = time.perf_counter()
        answer: dict = {"id": req.get("id")}
        try:
            exp = config_mod.from_dict(req["config"])
            if fault.startswith("abort:") and fault[6:] in exp.name:
                os.abort()
            cal = req.get("calibration")
            report = runner.run(exp, backend=req.get("backend", "cpu"),
                                calibration=calibration_from_dict(cal, "the request")
                                if cal else None,
                                compile_unfit=req.get("keep_unfit", False))
            plan = report.inputs.plan.to_bytes() if report.inputs.plan else b""
            answer.update(status="ok", message="", report=report.to_dict(groups=False),
                          features=report.calibration_features(),
                          inputs=report.inputs.to_dict(), hlo=report.inputs.hlo_text,
                          plan=base64.b64encode(plan).decode())
        except ConfigError as e:
            answer.update(status="refused", message=str(e).splitlines()[0])
        except Exception as e:  # noqa: BLE001 -- a compiler error is this config's result
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            answer.update(status="error", message=f"{type(e).__name__}: {first}"[:500])
        answer["wall_s"] = time.perf_counter() - t0
        out.write(json.dumps(answer, default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
