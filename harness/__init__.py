"""What the tests and the benchmarks both run: the real server as a subprocess (``servers``), the fault scenarios
against it (``faults``) and the benchmark photos (``photos``). It imports neither ``tests`` nor ``bench``."""
