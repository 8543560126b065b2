import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models: one intra-op thread is fastest, and it keeps the suite fast on a shared 2-core machine
    (spinning OpenMP workers of several processes slow each other down by 10x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
