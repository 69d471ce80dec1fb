"""Development tooling, never imported by the glue at run time on a GPU cluster (a test guards it): verl and OpenRLHF
on CPU, the launcher, tiny offline assets, the CPU quickstart and its last-digit task, the package map's generator."""
