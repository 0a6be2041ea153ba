"""The autotune scenario: the RAM tier tuned by load against fixed settings, on traces whose
working set outgrows the budget.

A package of its own because `scenarios/` holds its twelve modules already: `workload`
builds the traces, `configs` the configurations and their config files, `scenario` plays
each trace under each configuration and writes the rows.
"""
