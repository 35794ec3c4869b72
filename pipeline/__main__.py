"""`python -m shardflow` is the `shardflow` command (tools/main.py)."""

from shardflow.tools.main import main

main()
