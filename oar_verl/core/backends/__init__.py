"""Backends: the one interface every attribution method is written on (docs/method.md §10), its runtimes (a Hugging
Face or FSDP module, Ulysses sequence shards), token budgets, the memory model and collective alignment."""
