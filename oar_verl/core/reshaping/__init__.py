"""From importance to advantages: bi-level gating with mass preserved, the per-token advantages and the diagnostics
logged as ``oar/*`` (docs/method.md §5, §9)."""
