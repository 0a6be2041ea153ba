"""The SSD tier: one checked safetensors file per entry, an SQLite index, a writer thread
that drops rather than blocks, folder health, reconcile and eviction, and the wear meter."""
