"""Which models there are and how they load: local MLX folders and LM Studio keys
(`discovery`), loading with their output format (`loading`), the memory preflight before a
load (`preflight`), and the built-in demo models (`demo/`)."""
