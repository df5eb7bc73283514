"""The emulated devices' state directory: created 0700, checked before use, never through a link."""

from __future__ import annotations

import os
import stat

import pytest

from streambox.device import DeviceError
from streambox.device.emulated import EmulatedBackend
from streambox.device.ledger import Ledger, ensure_state_dir, ledger_path
from streambox.device.specs import V100_16GB, MiB

SPEC = V100_16GB.with_overrides(
    name="ledger-dir", total_memory=64 * MiB, context_create_s=0.0, context_memory=0
)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_state_dir_is_private_and_a_loose_one_of_ours_is_tightened(tmp_path):
    fresh = ensure_state_dir(tmp_path / "a" / "state")
    assert _mode(fresh) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    ensure_state_dir(loose)
    assert _mode(loose) == 0o700
    with EmulatedBackend(spec=SPEC, state_dir=tmp_path / "b").open_runtime(0) as rt:
        assert rt.memory_info()[1] == 64 * MiB
    assert _mode(tmp_path / "b") == 0o700


def test_a_planted_link_is_refused_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.mkdir()
    link = tmp_path / "streambox-state"
    link.symlink_to(target)
    with pytest.raises(DeviceError, match="is a symbolic link; remove it or point STREAMBOX_STATE_DIR"):
        EmulatedBackend(spec=SPEC, state_dir=link).open_runtime(0)
    assert list(target.iterdir()) == []  # nothing was created through the link
    # A link in place of the ledger file itself is not followed either.
    state = ensure_state_dir(tmp_path / "state")
    ledger = ledger_path(state, 0, SPEC.name, SPEC.total_memory)
    ledger.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DeviceError, match="links are not followed"):
        Ledger.open(ledger, SPEC.total_memory)
    assert not (tmp_path / "elsewhere").exists()


def test_a_file_in_place_of_the_dir_is_refused(tmp_path):
    (tmp_path / "state").write_text("")
    with pytest.raises(DeviceError, match="is not a directory"):
        ensure_state_dir(tmp_path / "state")
