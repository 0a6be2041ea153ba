"""The bench's scenarios, one module each; `registry` names them and runs one by name.

Each measures ours against `mlx_lm.server` or against itself with a part turned off, side by
side in one run, and returns `results.ScenarioResult` rows; what needs mlx runs in a child
process (`python -m bench.scenarios.speculative`, `engine_bridge.probes`), never here.
"""
