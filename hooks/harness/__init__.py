"""The harness's components: model, data, parallelism, checkpoints, and one step's work."""
