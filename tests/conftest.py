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


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """Step cost curves (deepspec.decoding.schedule) measured by the tests go to a folder of the session, never to
    the user's ~/.cache, and no curve measured on another run is read back."""
    import os

    before = os.environ.get("DEEPSPEC_CACHE_DIR")
    os.environ["DEEPSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("deepspec-cache"))
    yield
    if before is None:
        os.environ.pop("DEEPSPEC_CACHE_DIR", None)
    else:
        os.environ["DEEPSPEC_CACHE_DIR"] = before
