"""One-off GPU probes and diagnostics (each a script with its command in its docstring), kept apart
from the benches in benchmarks/ whose results benchmarks/RESULTS.md records as current numbers."""
