"""The OpenRLHF tests: subprocesses in the separate .venv-openrlhf environment (see test_openrlhf.py)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "openrlhf: runs OpenRLHF 0.11.2's classes on CPU in the .venv-openrlhf environment")
