"""HTTP routes: parse and validate, hand typed records to the scheduler, shape replies."""
