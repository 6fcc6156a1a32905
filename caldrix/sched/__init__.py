"""The step scheduler: sole owner of sequences and KV slots.

policy.py decides (pure, synchronous); loop.py receives submissions, awaits engine steps on the
lanes' step threads (runners.py picks the thread, threads.py is the thread) and emits events.
Nothing outside this package touches a Sequence.
"""
