"""What a job is, checked before any GPU time: the spec, prompt files, turns and tool calls, the
chat template, the shard plan, and `toolkit check`."""
