"""Exit statuses of `swarmd` and `swarmctl`, named once so units, tests and scripts agree.

Values follow sysexits-style conventions where systemd cares: 0 is a clean stop (no restart under
Restart=on-failure), anything else is a failure systemd restarts, except EXIT_CONFIG, which
the unit lists in RestartPreventExitStatus because retrying a bad config cannot help.
"""

EXIT_OK = 0
EXIT_FAILURE = 1  # an unexpected error; the traceback is in the log
EXIT_CONFIG = 2  # bad flags, variables or config file (argparse uses 2 for bad usage too)
EXIT_BOOTSTRAP = 3  # --require-bootstrap and no bootstrap peer answered in time
EXIT_UNAVAILABLE = 4  # swarmctl: the daemon is not running or refused us
EXIT_FORCED = 130  # a second signal during drain: stopped at once, state may not be flushed
