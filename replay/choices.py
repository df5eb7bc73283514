"""The names a workload's shaping accepts (`--select`, `--pattern`, `--mapping`, `--spacing`), apart
from `shaping` itself so that building the command line (`streambox replay --help`) imports no numpy."""

from __future__ import annotations

PATTERNS = ("sporadic", "periodic", "bursty")
SELECTIONS = ("volume", "random", "stratified")
MAPPINGS = ("round-robin", "stripe", "explicit")
SPACINGS = ("poisson", "even", "trace")
