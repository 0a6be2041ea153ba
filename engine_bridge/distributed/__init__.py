"""One model across several processes or Macs through `mx.distributed` (issue 34).

`world` (the ranks this process belongs to, and how rank 0 shares what it decided),
`shard` (a model split with mlx-lm's own `shard` or `pipeline`, or refused), `launch`
(the `mlx.launch` command line that starts every rank).
"""
