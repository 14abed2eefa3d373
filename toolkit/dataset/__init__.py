"""What the shards become: the merge, the audit and its report, and the exports."""
