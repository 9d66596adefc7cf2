import sys
from pathlib import Path

# tests/ helpers (hf_tiny) are plain modules next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
