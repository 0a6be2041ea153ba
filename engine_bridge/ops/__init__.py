"""Running the process: the memory guard and what the heap gives back (`memory`, `heap`),
and the request counters and log behind /v1/cache/stats and /v1/cache/requests."""
