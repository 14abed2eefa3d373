"""What talks to Slurm: submit, the task objects submitit runs, status, logs, retry."""
