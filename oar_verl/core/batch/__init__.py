"""The attribution batch: verl's padded layout as rows the methods run on, the outcome probes, seeded hashing and the
choice of rows to attribute (docs/method.md §2)."""
