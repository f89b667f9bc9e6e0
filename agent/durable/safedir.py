"""The agent's directories: private to the user, never taken over from someone else.

The default directory (``/tmp/rankwatch-<uid>``, :func:`rankwatch.address.default_dir`)
lives in a world-writable place, so another local user could create it first and
wait: with a directory of theirs, they could plant a symlink where the agent appends
incidents, or a socket of their own where the ranks connect.  So the agent uses it only
if it is a real directory (not a symlink), owned by the user, with mode 0700; else it
refuses to start, with an error that says what to do.  A directory the agent makes is
made 0700.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from rankwatch.address import Address, default_dir

__all__ = ["UnsafeDirectory", "check_default", "private_dir"]


class UnsafeDirectory(RuntimeError):
    """A directory the agent will not use."""


def private_dir(path: Path, repair: bool = False) -> Path:
    """Make ``path`` (mode 0700) unless it exists; check it is the user's own and private.

    The parent must exist.  ``path`` itself is never followed if it is a symlink.
    ``repair``: a directory of the user's that is open to others is made 0700 instead
    (for a directory inside one already checked private: nobody else could reach it).

    Raises:
        UnsafeDirectory: a symlink, not a directory, another user's, or open to others.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    fix = "remove it (or set $RANKWATCH_TMPDIR, --listen and --state-dir elsewhere) and start again"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"{path} is a symlink (to {os.readlink(path)}); refusing to follow it: {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory: {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                              f"someone else made it first: {fix}")
    if stat.S_IMODE(st.st_mode) & 0o077 and repair:
        os.chmod(path, 0o700, follow_symlinks=False)
    elif stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeDirectory(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, open to other users; it "
                              f"must be 0700: {fix} (or `chmod 700 {path}` if you made it)")
    return path


def check_default(listen: Iterable[Address], state_dir_default: bool = False) -> Path:
    """Check (making it if needed) the default directory, if a socket or the state lives there.

    Returns:
        The default directory.

    Raises:
        UnsafeDirectory: as :func:`private_dir`.
    """
    base = Path(default_dir())
    if state_dir_default or any(a.path is not None and Path(os.path.abspath(a.path)).parent == base
                                for a in listen):
        private_dir(base)
    return base
