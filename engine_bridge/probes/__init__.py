"""The benchmark's in-process measurements (`python -m engine_bridge.probes.shapes`).

They need mlx, and only engine_bridge/ imports mlx, so they live here rather than in
bench/, which runs them as child processes; nothing in the engine imports them."""
