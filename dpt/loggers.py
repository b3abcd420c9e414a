"""The names of dpt's loggers, for every part of the package (dpt.observe.logs sets them up).

- `dpt`: a process's own lines; each rank says its own (`[rank 1] epoch 1 | step 20 | ...`).
- `dpt.once`: what every rank of a run would say alike (what the data set holds, what a setting
  leads to): on the console from rank 0 alone, in every rank's log file. A launching process
  that builds the data set first, to check it (dpt.launch.preflight), keeps them to its log.
"""

from __future__ import annotations

LOGGER_NAME = "dpt"
ONCE_LOGGER_NAME = f"{LOGGER_NAME}.once"
