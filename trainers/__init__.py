"""shardflow's training side: the Task protocol, precision (AMP), the step and the loop,
checkpoints. See trainers/README.md."""
