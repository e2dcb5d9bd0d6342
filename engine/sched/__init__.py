"""Scheduling (engine-core process): continuous batching, the paged KV block manager, prefix hashing."""
