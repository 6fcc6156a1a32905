"""bench/serve.py's parts: common, peers, workloads, report."""
