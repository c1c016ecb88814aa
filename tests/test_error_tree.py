"""One root for swarmd's own exceptions (issue 17): a broad `except SwarmdError` means "an expected
failure" only if every exception class swarmd defines sits under it. A new class outside the tree
fails here with its module and name, unless it is listed below with the reason it stands apart."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import swarmd
from swarmd.errors import LocalError, PeerError, SwarmdError

#: Classes that are not swarmd failures on purpose, with why.
OUTSIDE_THE_TREE = {
    # The simulator's invariant check is a failed assertion of a test, not a runtime failure.
    "swarmd.stage.simulation.Violation",
}


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(swarmd.__path__, "swarmd."):
        if info.name.endswith("__main__"):
            continue  # runs a program on import
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                found[f"{info.name}.{name}"] = cls
    return found


def test_every_swarmd_exception_has_the_one_root():
    classes = _exception_classes()
    assert len(classes) > 20, "the walk found too few exception classes to mean anything"
    outside = sorted(name for name, cls in classes.items()
                     if not issubclass(cls, SwarmdError) and name not in OUTSIDE_THE_TREE)
    assert outside == [], f"exceptions outside SwarmdError: {outside}"
    assert set(OUTSIDE_THE_TREE) <= set(classes), "an exemption names a class that no longer exists"


def test_the_split_says_whose_fault_it_is():
    classes = _exception_classes()
    for name in ("swarmd.errors.ConfigError", "swarmd.model.precision.PrecisionError",
                 "swarmd.stage.errors.AlreadyServed", "swarmd.tokenfile.TokenFileError",
                 "swarmd.job.opening.NotAFile"):
        assert issubclass(classes[name], LocalError), name
    assert issubclass(classes["swarmd.values.ValueRefused"], PeerError)
    # The ones that keep a builtin base keep it for the callers that catch the builtin.
    assert issubclass(classes["swarmd.job.opening.NotAFile"], OSError)
    assert issubclass(classes["swarmd.values.ValueRefused"], ValueError)
