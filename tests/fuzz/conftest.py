"""The fuzz harness modules live next to the tests; pytest's importlib mode does not put this folder
on sys.path, and bench/fuzz.py imports the same modules, so the folder is added here once."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
