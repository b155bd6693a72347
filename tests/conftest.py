import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def single_thread():
    """Tiny tensors: intra-op threading only adds synchronization cost (and flakiness
    when the machine is loaded)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
