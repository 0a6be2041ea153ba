"""A split model behind one port: the front process that relays to rank 0 and starts
the ranks again when one is lost (docs/distributed.md)."""
