"""The `shardflow` command and its subcommands, the benchmarks and the GPU check: the layer
above the library (`shardflow`) and the training side (`shardflow.trainers`). See
tools/README.md."""
