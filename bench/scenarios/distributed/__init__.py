"""The distributed scenario (issue 34): one model split across two ranks, ours against
mlx_lm.server's own distributed mode and against ours on one rank.

A package of its own because `scenarios/` holds its twelve modules already: `worlds`
starts and stops the servers (each rank of a world a process of its own, started through
`mlx.launch`), `scenario` drives them and writes the rows.
"""
