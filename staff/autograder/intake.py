"""The submission's intake: which of a submission's files (a folder, loose files or make_submission.sh's zip,
read in memory and never extracted) provide the task files, read without following links, blocking or
reading past a size limit. The grading command (grade.py) and the staff review (review.py) both take a
submission through here, so they always look at the same bytes."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

from .sanitize import one_line

MAX_SUBMITTED_FILE_BYTES = 1 << 20
# A submission is seven small files: these bounds keep reading it (as root, before the tests) short whatever it is.
MAX_SUBMISSION_ENTRIES = 10_000  # files looked at in the submission folder, entries in a zip's central directory
MAX_ZIP_BYTES = 16 << 20  # a zip larger than this is not opened
MAX_ZIP_DIRECTORY_BYTES = 2 << 20  # nor one whose central directory is larger


# ---- the submission ---------------------------------------------------------------------------------------
def task_files(tree: Path) -> list[str]:
    """The task files a submission provides: the stubs' paths in the staff tree."""
    return sorted(p.relative_to(tree).as_posix() for p in (tree / "fsdp_assignment").glob("task[0-9]_*.py"))


def find_submitted(submission: Path, wanted: list[str]) -> tuple[dict[str, bytes], list[str]]:
    """Map each wanted task file to the submitted file that provides it; notes for the student.

    First the exact repository path (``fsdp_assignment/task3_forward.py``, as make_submission.sh zips it),
    else a file with that name anywhere (an upload of loose files, or a zip of the folder); symlinks, hidden
    or macOS metadata folders, and oversized files are ignored. Returns the chosen files' contents."""
    found: dict[str, bytes] = {}
    notes: list[str] = []
    candidates: dict[str, list[Path]] = {}
    if submission.is_dir():
        import itertools
        paths = list(itertools.islice(submission.rglob("*"), MAX_SUBMISSION_ENTRIES + 1))
        if len(paths) > MAX_SUBMISSION_ENTRIES:
            notes.append(f"your submission holds more than {MAX_SUBMISSION_ENTRIES} files; only the first "
                         f"{MAX_SUBMISSION_ENTRIES} were looked at (submit the task files only)")
            paths = paths[:MAX_SUBMISSION_ENTRIES]
        for path in sorted(paths):
            rel = path.relative_to(submission)
            if any(part.startswith(".") or part == "__MACOSX" for part in rel.parts):
                continue
            if path.is_symlink() or not path.is_file():
                continue
            candidates.setdefault(path.name, []).append(path)
    for want in wanted:
        name = Path(want).name
        exact = submission / want
        paths = [exact] if exact in candidates.get(name, []) else \
            sorted(candidates.get(name, []), key=lambda p: (len(p.relative_to(submission).parts), str(p)))
        if not paths:
            notes.append(f"{want}: not found in your submission, so the stub is graded in its place "
                         f"(tests that need it score 0)")
            continue
        chosen = paths[0]
        shown = one_line(str(chosen.relative_to(submission)))
        data, why = read_submitted(chosen, MAX_SUBMITTED_FILE_BYTES)
        if data is None:
            notes.append(f"{want}: {shown} was ignored ({why}); the stub is graded in its place")
            continue
        if len(paths) > 1:
            notes.append(f"{want}: several files named {name} in your submission; graded {shown}")
        found[want] = data
    return found, notes


def read_submitted(path: Path, limit: int) -> tuple[bytes | None, str]:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes, else (None, why). Opened without
    following a link and without blocking (a FIFO or a device never stalls us), checked on the open file
    (fstat), and read no further than ``limit``: a submission.zip that was a link to /dev/zero had grade.py, as
    root, read without end (issue 25)."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        return None, ("a link (only plain files are read)" if err.errno == errno.ELOOP
                      else f"unreadable: {err.strerror}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a plain file (only plain files are read)"
        if st.st_size > limit:
            return None, f"{st.st_size} bytes, more than {limit}"
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            return None, f"more than {limit} bytes"
        return data, ""
    except OSError as err:
        return None, f"unreadable: {err.strerror}"
    finally:
        os.close(fd)


def zip_too_big(data: bytes) -> str:
    """Why the zip ``data`` is not to be parsed, or "": the entry count and size its end-of-central-directory
    record declares, read before zipfile parses the directory (400,000 entries took 2 s and 234 MiB)."""
    tail = data[-(1 << 16) - 22:]
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) < at + 22:
        return "not a zip file"
    entries = int.from_bytes(tail[at + 10:at + 12], "little")
    directory = int.from_bytes(tail[at + 12:at + 16], "little")
    if entries == 0xFFFF or directory == 0xFFFFFFFF:
        return "a zip64 archive"
    if entries > MAX_SUBMISSION_ENTRIES or directory > MAX_ZIP_DIRECTORY_BYTES:
        return f"{entries} entries, {directory} bytes of directory"
    return ""


def find_in_zips(submission: Path, wanted: list[str]) -> tuple[dict[str, bytes], list[str]]:
    """Task files inside a .zip uploaded as is (make_submission.sh's zip, not unzipped): exact path first, else by
    file name; read in memory, never extracted."""
    import zipfile
    found: dict[str, bytes] = {}
    notes: list[str] = []
    import itertools
    archives = sorted(itertools.islice(submission.rglob("*.zip"), 16)) if submission.is_dir() else []
    for archive in archives:
        name = one_line(archive.name)
        data, why = read_submitted(archive, MAX_ZIP_BYTES)
        why = why or zip_too_big(data)
        if why:
            notes.append(f"{name}: not opened ({why}); submit the task files, or make_submission.sh's zip")
            continue
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                infos = [i for i in zf.infolist() if not i.is_dir() and "__MACOSX" not in i.filename]
                for want in wanted:
                    if want in found:
                        continue
                    hits = [i for i in infos if i.filename == want] or \
                        [i for i in infos if i.filename.rsplit("/", 1)[-1] == Path(want).name]
                    if hits and hits[0].file_size <= MAX_SUBMITTED_FILE_BYTES:
                        found[want] = zf.read(hits[0])
                        notes.append(f"{want}: taken from {name}/{one_line(hits[0].filename)}")
        except (zipfile.BadZipFile, OSError, ValueError, RuntimeError, EOFError, NotImplementedError) as err:
            notes.append(f"{name}: not read ({type(err).__name__}: {one_line(str(err))[:200]})")
            continue
    return found, notes


def take_submission(submission: Path, tree: Path) -> list[str]:
    """Copy the task files from ``submission`` into ``tree``; the notes for the student (every file or zip that
    was refused, and why, included)."""
    wanted = task_files(tree)
    found, notes = find_submitted(submission, wanted)
    missing = [w for w in wanted if w not in found]
    if missing:  # maybe the zip itself was uploaded
        zipped, zip_notes = find_in_zips(submission, missing)
        found.update(zipped)
        notes = [n for n in notes if n.split(":", 1)[0] not in zipped] + zip_notes
    install_submission(tree, found)
    return notes


def install_submission(tree: Path, found: dict[str, bytes]) -> None:
    for rel, data in found.items():
        dest = tree / rel
        dest.unlink(missing_ok=True)
        dest.write_bytes(data)  # contents only: no mode, owner or link comes along
