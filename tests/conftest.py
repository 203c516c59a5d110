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


def pytest_terminal_summary(terminalreporter):
    """Say plainly which paths this machine did not run (the skipped cases by
    reason: CUDA kernels without a GPU, CPU instruction sets it lacks)."""
    reasons = {}
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.section("paths this machine did not run")
        for reason, n in sorted(reasons.items(), key=lambda x: -x[1]):
            terminalreporter.write_line(f"{n:5d} skipped: {reason}")
