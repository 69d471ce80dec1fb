"""CPU stand-in for the parts of ``flash_attn`` that OpenRLHF 0.11.2 imports at module level (see ../README.md).

Only for the CPU test environment ``.venv-openrlhf``; the attention kernels are not provided.
"""

__version__ = "2.8.3+cpu"
