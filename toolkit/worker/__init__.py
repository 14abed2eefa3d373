"""What one array task runs on a GPU node: a shard, from its engine's start to its done manifest."""
