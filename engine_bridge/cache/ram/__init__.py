"""The RAM tier: content-addressed blocks and checkpoints, matched against a request, pinned
while restored, evicted by LRU and by which checkpoints a deeper one supersedes."""
