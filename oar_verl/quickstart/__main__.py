"""``python -m oar_verl.quickstart``: the CPU quickstart (:mod:`oar_verl.quickstart.main`)."""

from oar_verl.quickstart.main import main

main()
