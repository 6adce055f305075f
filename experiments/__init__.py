"""What users run: experiment configs, the runner, and the `shardscope` CLI.

Rooms:
- `config.py`: the TOML schema (tables map 1:1 onto ModelConfig, Parallelism, Workload,
  Precision, Train), the loader, `--set` overrides, cross-table checks, `ConfigError`.
- `runner.py`: Experiment -> backend, mesh, rules, program, analytic memory ->
  `sharding.analyze` -> Report.
- `cli.py`: the `shardscope` command (run, inspect, systems, models); one-line errors.
- `configs/`: bundled experiments (public runs and examples).

Imported by nobody but tests.
"""
