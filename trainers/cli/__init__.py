"""The training side's subcommands of `shardflow` (pipeline/cli/main.py): train, demo, soak,
plot."""
