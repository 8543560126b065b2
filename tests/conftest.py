import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _cost_cache(tmp_path_factory):
    """Engines with CPU policies measure the miss-service cost model once per shape: keep it out of ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OLED_COST_CACHE", str(tmp_path_factory.mktemp("costs")))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models: one intra-op thread is fastest, and it keeps the suite fast on a shared 2-core machine
    (spinning OpenMP workers of several processes slow each other down by 10x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
