"""Attribution methods, each written once over the backend interface and registered under ``algorithm.oar.mode``:
OAR-G (``gradient``), OAR-P (``perturbation``, with its policies and mask operators), ``fisher`` and ``path``
(docs/method.md)."""
