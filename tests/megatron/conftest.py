"""The Megatron engine tests: subprocesses in the separate .venv-mcore environment (see test_megatron_attribution)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "megatron: runs verl's Megatron engine on CPU in the .venv-mcore environment")
