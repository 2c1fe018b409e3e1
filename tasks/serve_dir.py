"""``--serve-dir``, trusted only when safe: this user's own folder, closed to everyone else.

It holds every client's prompts and results, and the server reads back the records it finds there, so
another user who can write into it (a 0777 scratch folder, a planted record) could make it serve what
it should not. :func:`serve_dir_problem` is checked with the flags; what the server creates is 0700/0600.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600
SUBDIRS = ("files", "batches", "keys")  # what BatchStore keeps in the folder (keys/<owner>/{files,batches})


def serve_dir_problem(root: str | os.PathLike) -> str | None:
    """Why ``root`` (or a folder the store keeps in it) cannot be trusted, with the fix; None when it can
    (or does not exist yet: it will be created 0700)."""
    root = Path(root)
    if not root.exists():
        return None
    if not root.is_dir():
        return f"--serve-dir {root}: not a folder"
    folders = [root] + [root / s for s in SUBDIRS if (root / s).is_dir()]
    keys = root / "keys"
    if keys.is_dir():
        folders += [p for p in keys.iterdir() if p.is_dir()]
    for folder in folders:
        st = folder.lstat()
        if stat.S_ISLNK(st.st_mode):
            return f"--serve-dir {root}: {folder} is a symbolic link; the state folder must hold only its own folders"
        if st.st_uid != os.geteuid():
            return (f"--serve-dir {root}: {folder} belongs to another user (uid {st.st_uid}); use a folder of your "
                    "own (it is created 0700 when missing)")
        if st.st_mode & 0o022:
            return (f"--serve-dir {root}: {folder} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                    f"run 'chmod -R go-rwx {root}' or use a new folder")
    return None


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents inside the state folder) as 0700; an existing one is left as is."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    return path
