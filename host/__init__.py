"""What a long extraction run on one preemptible host needs around the model: storage, shard
finalisation in the background, checkpoints, exactly-once resume, signals and progress."""
