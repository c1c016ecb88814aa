"""The job tests' real daemons and helpers: the shared fixtures of tests/_support/jobswarm.py."""

from jobswarm import kit, swarm, swarm_root, swarmctl  # noqa: F401 (fixtures)
