"""The test session's own setup (tests/conftest.py) that CI time depends on."""

from __future__ import annotations

import os


def test_one_openmp_thread_per_test_process():
    """torch's OpenMP threads spin while they wait: one per core in each xdist worker made the
    transformers references ~11x slower beside the other worker."""
    import torch
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == 1
