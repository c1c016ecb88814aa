"""`[model] init` is a path from a job spec, which a stranger may publish to the DHT: every stage
peer that serves the job opens it. Whatever it names, the peer must refuse at once with an
ExportError rather than block a thread on a FIFO or read a device without end."""

import os

import pytest

from swarmd.model.export import ExportError
from swarmd.model.init import stage_digests


def test_a_fifo_is_refused_without_blocking(tmp_path):
    """1. A FIFO nobody writes to (opening it for reading would block for ever).
       2. stage_digests refuses it as not a regular file, and returns."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ExportError, match="not a regular file"):
        stage_digests(tmp_path)


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused(tmp_path, target):
    with pytest.raises(ExportError, match="not a regular file"):
        stage_digests(target)


def test_a_symlink_to_a_device_is_refused(tmp_path):
    link = tmp_path / "weights.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(ExportError, match="cannot open"):
        stage_digests(link)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ExportError, match="cannot open"):
        stage_digests(tmp_path / "nothing.safetensors")
