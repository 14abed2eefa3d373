"""On-disk formats every part of the toolkit shares: the run directory, records, shard files,
manifests and locks, progress files, atomic file writes, and how times and ranges read."""
