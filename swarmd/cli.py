"""`swarmd`: parse flags, build the one Config, run the daemon, turn its outcome into an exit status.

Bad configuration is the operator's mistake, not a crash: it gets one line on stderr naming the file
(or variable, or flag) and the key, and exit status 2, the same status argparse uses for bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from swarmd import config as configuration
from swarmd.exitcodes import EXIT_CONFIG, EXIT_OK
from swarmd.version import package_version


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarmd",
        description="The swarmd peer daemon: one per machine, joins a swarm that trains models together.",
    )
    p.add_argument(
        "--config", metavar="FILE",
        help=f"TOML config file [{configuration.CONFIG_ENV}; default {configuration.DEFAULT_CONFIG_FILE} when present]",
    )
    configuration.add_flags(p)
    p.add_argument("--version", action="version", version=f"swarmd {package_version()}")
    p.add_argument("--check-config", action="store_true", help="validate (settings and the swarm key file), print the effective config, exit")
    return p


def _check_combinations(config: configuration.Config) -> None:
    """Settings valid one by one may still not go together (a jitter of 1 or more); the daemon
    refuses them as it builds its parts, and --check-config must refuse them the same way."""
    from swarmd.jobs.rebalancing import RebalanceSettings

    RebalanceSettings.from_section(config.rebalance)  # raises ConfigError naming the key


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = configuration.load(args, os.environ)
        if args.check_config:
            configuration.load_swarm_key(config.network)  # what the daemon checks first when it starts
            _check_combinations(config)
    except configuration.ConfigError as exc:
        print(f"swarmd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        sys.stdout.write(configuration.to_toml(config))
        return EXIT_OK
    from swarmd.daemon import run

    return run(config, reload=lambda: configuration.load(args, os.environ))


if __name__ == "__main__":
    sys.exit(main())
