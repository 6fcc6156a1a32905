"""The step scheduler: sole owner of sequences and KV slots.

policy.py decides (pure, synchronous); loop.py receives submissions, awaits engine steps in a
worker thread and emits events. Nothing outside this package touches a Sequence.
"""
