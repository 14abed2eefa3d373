"""What an array task runs on a GPU node for each shard it claims: the shard, from its engine's
start to its done manifest."""
