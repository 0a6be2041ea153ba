"""MLX's launcher (`mlx.launch`, the same arguments), without the core its relay spins.

Run as `python -m engine_bridge.distributed.quiet_launch ARGS`: what `launch.command`
starts. mlx.launch (mlx 0.32.4) relays each rank's output on a thread of its own, which
waits in `select` on the rank's stdout and stderr and on its stdin being writable, whether
or not anything waits to be written. A pipe's writing end always is writable, so `select`
returns at once and every relay thread loops flat out: measured here, the launcher of two
idle ranks keeps a core busy. On a Mac that core is taken from the ranks' own work (and
from the battery); on this project's 2-core test machine, from half of everything.

The only change is what its relay asks `select`: never whether a rank's stdin is writable.
Nothing is relayed to a rank's stdin then, and no rank here reads one (rank 0 answers HTTP;
the others follow it). Output, exit codes, the ssh of remote hosts, the ports and each
rank's environment stay mlx.launch's own. The launcher's own stdin must stay open (the
supervisor gives it a pipe): on /dev/null, its main loop reads end-of-file at once and
spins too.
"""

from __future__ import annotations

import select
import sys
from typing import Any

from mlx._distributed_utils import launch


def _select_reads(rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> tuple:
    """`select` asked only about reads and errors: a relay waits for output, or times out."""
    readable, _, errors = select.select(rlist, [], xlist, timeout)
    return readable, [], errors


def main() -> int:
    # The launcher module's own name for `select`, which both its loops call.
    launch.select = _select_reads
    return launch.main() or 0


if __name__ == "__main__":
    sys.exit(main())
