import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on an oversubscribed CPU a 2-thread pool
    can make each small op wait milliseconds for a descheduled worker."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
