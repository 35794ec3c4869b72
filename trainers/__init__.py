"""shardflow's training side: the Task protocol, precision (AMP), the step, the loop,
checkpoints and distributed setup. Nothing is exported yet: it arrives with the trainer issue."""
