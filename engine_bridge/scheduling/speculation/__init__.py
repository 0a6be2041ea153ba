"""Speculative decoding: drafters propose tokens, the model checks a run of them in one pass.

- `drafters`: where proposals come from (prompt lookup; the test drafters live in tests/).
- `mtp`: the drafter that runs the head Qwen3.5/3.6 checkpoints ship (`mtp.*`, read back by
  models/mtp_head.py); the runner primes it at prefill and feeds it every committed
  position.
- `acceptance`: the rule that keeps the output the model's own, greedy or sampled.
- `control`: how many tokens to draft for a sequence, from its running acceptance.

The runner decides when a sequence verifies; `verify` runs the pass, and going back to the accepted
prefix is the caches' business (kv/rollback.py).
"""
