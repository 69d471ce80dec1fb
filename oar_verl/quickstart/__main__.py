"""``python -m oar_verl.quickstart``: the CPU quickstart (:mod:`oar_verl.quickstart.main`); its exit status is the
quickstart's (non-zero when the trainer run failed), so scripts and CI can rely on it."""

import sys

from oar_verl.quickstart.main import main

sys.exit(main())
