"""One process's `/proc/<pid>/stat`, split into fields: what the ledger (a slot owner's start time),
the template (its children) and the proxy (an instance's CPU time) read from it."""

from __future__ import annotations


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of `/proc/<pid>/stat` after the command (field 3, the state, comes first), or None
    when the process is gone. The command is skipped whole: it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].split()
