"""Discrete-event simulator of stage assignment under preemption; runs swarmd.rebalance.policy."""
