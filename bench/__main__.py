"""`python -m bench`: the same as `mlx-prompt-cache bench`."""

from . import main

raise SystemExit(main())
