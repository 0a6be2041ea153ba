"""Client sessions over the cache tiers: listing, deleting, pinning and expiring them
(`catalog`), the admin coroutines the HTTP routes await (`admin`), and forgetting registry
entries neither tier holds (`prune`)."""
