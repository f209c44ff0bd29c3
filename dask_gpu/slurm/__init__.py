"""Runs beside Slurm (a scaler's process, a worker in a Slurm job): worker jobs that follow the queue, the scaling policy (pure), what a job gave its worker; trusts Slurm's own clients."""
