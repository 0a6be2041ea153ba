"""The shared tier: cache entries in a Redis or Valkey several machines point at.

This package's `__init__` imports nothing: `redis` is an optional extra, imported only by
`store`, so the base install can import the cache without it."""
