import pytest
import torch


def pytest_collection_modifyitems(config, items):
    have_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if have_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not have_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.fixture
def jit_cache(tmp_path, monkeypatch):
    """A private, empty cubin cache for one test (the package builder re-reads it)."""
    from flashinfer_jit._jit import BUILDER

    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHINFER_JIT_CUBIN_PATH", raising=False)
    saved = BUILDER._cache
    BUILDER._cache = None
    yield tmp_path / "cache"
    BUILDER._cache = saved


@pytest.fixture
def fresh_replays():
    """Every op runner's replays empty before and after the test (a test that stubs the
    kernels must not leave its plans to the next)."""
    from flashinfer_jit.registry import OPS

    def clear() -> None:
        for op in OPS.values():
            for runner in list(op._runners.values()):
                runner.replays.clear()

    clear()
    yield
    clear()
