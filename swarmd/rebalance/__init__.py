"""Gossiped load view and the pure rebalancing policy shared by the daemon and the simulator."""
