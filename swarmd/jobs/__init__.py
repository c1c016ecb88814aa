"""Jobs in a daemon: submissions checked against the submitting user, published in the DHT, and
the jobs other daemons published, with the peers that serve their stages."""

from swarmd.jobs.registry import JOB_STATES, Job, JobRegistry, JobRequestError

__all__ = ["JOB_STATES", "Job", "JobRegistry", "JobRequestError"]
