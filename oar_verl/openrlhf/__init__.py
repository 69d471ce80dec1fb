"""OAR for OpenRLHF 0.11 (the only package of oar_verl that imports OpenRLHF; see docs/openrlhf.md)."""
