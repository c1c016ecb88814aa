"""The one place tests/_support joins sys.path: pytest's importlib mode gives a test module no way to
import a conftest, so the shared daemon harness, spec builder and `wait_for` live there as plain
modules (`from daemons import Spawner`, `from waiting import wait_for`, `from jobspec import write_job`)."""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = str(Path(__file__).parent / "_support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
