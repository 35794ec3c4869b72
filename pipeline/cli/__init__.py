"""The `shardflow` command: one subcommand per tool (main.py), each a module here or, for the
training side, in trainers/cli/. `python -m pipeline` is the same command."""
