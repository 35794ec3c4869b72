"""`python -m pipeline` is the `shardflow` command (pipeline/cli/main.py)."""

from pipeline.cli.main import main

main()
