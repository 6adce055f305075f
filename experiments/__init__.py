"""What users run: experiment configs, the runner, and the `shardscope` CLI.

Rooms:
- `config.py`: the TOML schema (tables map 1:1 onto ModelConfig, Parallelism, Workload,
  Precision, Train), the loader, `--set` overrides, cross-table checks, `ConfigError`.
- `runner.py`: Experiment -> backend, mesh, rules, program, analytic memory ->
  `sharding.analyze` -> Report.
- `cli.py`: the `shardscope` command (run, inspect, configs, systems, models, validate,
  calibrate, search, results, compare); one-line errors.
- `validate.py`, `calibrate.py`: the published runs against the estimate; the fit.
- `search.py`: enumerate shardings, order, run them on `worker.py` processes (or Ray tasks),
  rank, Pareto front, re-estimate; `store.py`: the SQLite results store.
- `compare.py`: one config on several systems, one compile per device count, power and cost.
- `configs/`: bundled experiments (public runs and examples), runnable by name.

Imported by nobody but tests.
"""
