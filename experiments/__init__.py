"""What users run: experiment configs, the runner, and the `shardscope` CLI."""
