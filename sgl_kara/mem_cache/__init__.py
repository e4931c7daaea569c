"""KV-slot glue: row compaction and the radix-cache insertion cap."""
