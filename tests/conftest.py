import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_fallback_counts(monkeypatch):
    """Each test starts with no recorded fallbacks and strict mode off."""
    from torch_cute_ops.ops import fallback

    monkeypatch.delenv("TORCH_CUTE_OPS_STRICT", raising=False)
    fallback.reset()
    yield


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True[, warn_only]) for one test, restored after."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda warn_only=False: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


def pytest_terminal_summary(terminalreporter):
    """The fuzz tests' figures (tests/fuzz_support.py): cases tried, failures."""
    support = sys.modules.get("fuzz_support")
    if support is not None and support.TALLY.cases:
        terminalreporter.write_line(support.TALLY.summary())


@pytest.fixture(scope="session")
def variant_ptx(tmp_path_factory):
    """``variant_ptx(spec)``: the PTX file of a kernel variant, compiled (no GPU needed) once per
    test run, however many tests read it."""
    from torch_cute_ops.kernels import compile_spec

    folders = {}

    def ptx_path(spec):
        if spec not in folders:
            folder = tmp_path_factory.mktemp(spec.digest)
            compile_spec(spec, dump_dir=folder)
            folders[spec] = folder
        (path,) = folders[spec].glob("*.ptx")
        return path

    return ptx_path
