"""The names of a machine's states, defined once for the host, the fleet and the index.

A checkpoint (``checkpoint.json``) is ``in_progress`` or ``completed``. A host's health
(``status.json``) goes

  starting -> loading -> running <-> compiling, then completed | stopped (a signal) | failed
"""

IN_PROGRESS = "in_progress"
STARTING, LOADING, COMPILING, RUNNING = "starting", "loading", "compiling", "running"
COMPLETED, STOPPED, FAILED = "completed", "stopped", "failed"
STATES = (STARTING, LOADING, COMPILING, RUNNING, COMPLETED, STOPPED, FAILED)  # status.json's, in order
CHECKPOINT_STATES = (IN_PROGRESS, COMPLETED)
