"""The crash soak (tests/tools/crash_soak.py) in CI: 5 seeded kill -9 rounds under concurrent
traffic on the three demo models; `scripts/soak --crash 50` runs the full count.

`pytest tests/ops/test_crash_soak.py -s` prints the per-round lines and the report's path.
"""

from __future__ import annotations

from tests.tools import crash_soak

CI_ROUNDS = 5
CI_SEED = 20261111


def test_kill_9_rounds_keep_the_cache_whole_consistent_and_equal_to_bypass(demo_root, tmp_path):
    soak = crash_soak.run(CI_ROUNDS, CI_SEED, tmp_path, demo_root=demo_root)
    totals = soak.totals()
    print(f"\n[crash soak] {tmp_path / 'crash-soak.md'}: {totals}")
    assert soak.failures == [], "\n".join(soak.failures[:20])
    assert all(soak.targets().values()), soak.targets()
    assert totals["rounds"] == CI_ROUNDS
    assert (totals["torn"], totals["quarantined"], totals["inconsistent_after"]) == (0, 0, 0)
    assert totals["mismatches"] == 0 and totals["compared"] >= CI_ROUNDS, totals
    # The kills hit something: requests were cut in every round, and the restarts served
    # earlier rounds' prompts from the SSD.
    assert totals["kills_with_requests_in_flight"] == CI_ROUNDS, totals
    assert totals["probe_ssd_hits"] > 0 and totals["ssd_writes"] > 0, totals
