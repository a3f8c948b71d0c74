"""Where benchmarks write: reports under ``bench/results`` (committed), scratch under ``bench/.work`` (ignored)."""
from pathlib import Path

WORK = Path(__file__).resolve().parent / ".work"
RESULTS = Path(__file__).resolve().parent / "results"
