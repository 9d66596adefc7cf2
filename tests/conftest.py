import os
import sys
from pathlib import Path

# tests/ helpers (hf_tiny) are plain modules next to the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Every training process of the tests (and the subprocesses they start, which inherit this) would otherwise probe the
# CPU's matmul peak for the MFU log line: 12 fp32 2048^3 matmuls, ~2-6 CPU-s per rank. MFU is not what these tests
# check; tests/test_train_metrics.py covers the override and the probe.
os.environ.setdefault("MINDVL_PEAK_TFLOPS", "0.1")
