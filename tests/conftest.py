import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Every test runs on the CPU here; CUDA cases are parametrised in and skip with
# a reason on a machine without a GPU.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
