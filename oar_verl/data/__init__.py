"""Data preparation: GSM8K, MATH and MATH-500 in verl's RL parquet format (``python -m oar_verl.data.prepare``)."""
