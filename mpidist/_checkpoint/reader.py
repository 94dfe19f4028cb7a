"""Reading a save: only regular files inside it, every size and checksum checked. Local, no MPI.

A reader trusts nothing it did not write. It opens the directory the user
named (which may be a symbolic link), then everything inside it without
following links: the numbered save directory, the manifest and the data
files must be a real directory and regular files, never links to elsewhere,
FIFOs, devices or sockets (``O_NOFOLLOW`` and ``O_NONBLOCK`` on open, the
type checked again with ``fstat`` afterwards, so nothing can block or be
swapped in between). The manifest is checked whole
(:mod:`mpidist._checkpoint.validate`) and every data file's size compared
with what the manifest declares before any array is allocated: the memory
and time a read takes are bounded by the size of the save on disk.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import zlib
from pathlib import Path
from typing import Any, Optional

import numpy as np

from mpidist._checkpoint.format import (
    ARRAY_KINDS,
    BLOCK_BYTES_KEY,
    BLOCK_CRCS_KEY,
    MANIFEST,
    VERSION_PREFIX,
    PathLike,
    Piece,
    entry_array,
    io_threads,
    is_version_name,
    list_versions,
    memory_dtype,
    pread_into,
    run_tasks,
)
from mpidist._checkpoint.validate import MAX_MANIFEST_BYTES, decode_manifest
from mpidist._errors import CheckpointError, ChecksumError

__all__ = ["Report", "Save", "inspect", "read_checkpoint"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
_FILE_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISREG, "a regular file"),
)


def _file_kind(mode: int) -> str:
    return next((what for test, what in _FILE_KINDS if test(mode)), "an unknown kind of file")


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"{path} cannot be read: {exc.strerror or exc}")


def open_regular(dir_fd: int, name: str, path: Path) -> int:
    """Open the regular file ``name`` of directory ``dir_fd`` for reading; ``path`` names it in errors. Local.

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: it is anything but a regular file (a symbolic
            link, a directory, a FIFO, a device, a socket), or cannot be opened.
    """
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
            mode = os.fstat(fd).st_mode  # what was opened, should it have been replaced since the stat
            if stat.S_ISREG(mode):
                return fd
            os.close(fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _unreadable(path, exc) from None
    raise CheckpointError(
        f"{path} is {_file_kind(mode)}, not a regular file; a save holds only regular files, and "
        "mpidist opens nothing else in it (no links to elsewhere, FIFOs or devices)"
    )


def _open_directory(path: Path, dir_fd: Optional[int] = None, *, follow: bool) -> int:
    """Open directory ``path`` (only its last part, relative to ``dir_fd``, when given); links only with ``follow``."""
    target: Any = path.name if dir_fd is not None else path
    try:
        if not follow:
            mode = os.stat(target, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if not stat.S_ISDIR(mode):
                raise CheckpointError(
                    f"{path} is {_file_kind(mode)}, not a directory; a save is a directory of "
                    "regular files, and mpidist follows no links inside a checkpoint directory"
                )
        return os.open(target, _DIR_FLAGS | (0 if follow else os.O_NOFOLLOW), dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except NotADirectoryError:
        raise CheckpointError(
            f"{path} is not a directory; a checkpoint is a directory written by Checkpoint.save"
        ) from None
    except OSError as exc:
        raise _unreadable(path, exc) from None


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


class Save:
    """One save opened for reading: its directory (held open) and its checked manifest. Local.

    Use it as a context manager (or call :meth:`close`). ``directory`` is
    the save's path, ``manifest`` its manifest.
    """

    def __init__(self, directory: Path, fd: int, manifest: dict) -> None:
        self.directory, self.manifest, self._fd = directory, manifest, fd

    @classmethod
    def open(cls, path: PathLike) -> Save:
        """Open the save at ``path``: ``path`` itself if it holds a manifest (or is a ``ckpt-NNNNNN`` that lost
        it), else its newest ``ckpt-NNNNNN``.

        Raises:
            FileNotFoundError: ``path`` does not exist or holds no save.
            ChecksumError: the manifest is damaged.
            CheckpointError: the manifest is malformed, or something in the
                save is not a regular file or directory, or cannot be read.
        """
        root = Path(path)
        try:
            root_fd = _open_directory(root, follow=True)
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint {root} does not exist") from None
        try:
            if _exists(MANIFEST, root_fd) or (is_version_name(root.name) and not list_versions(root)):
                directory, fd = root, os.dup(root_fd)  # one save: its manifest is read (or found missing) below
            else:
                versions = list_versions(root)
                if not versions:
                    raise FileNotFoundError(
                        f"checkpoint {root} holds no complete checkpoint (expected "
                        f"{VERSION_PREFIX}NNNNNN/{MANIFEST} inside it, written by Checkpoint.save)"
                    )
                directory = versions[-1]
                fd = _open_directory(directory, root_fd, follow=False)
        except (FileNotFoundError, CheckpointError):
            raise
        except OSError as exc:
            raise _unreadable(root, exc) from None
        finally:
            os.close(root_fd)
        try:
            return cls(directory, fd, _read_manifest(fd, directory))
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def at(cls, directory: PathLike, manifest: dict) -> Save:
        """Open save ``directory`` whose ``manifest`` was already read and checked (by another rank)."""
        directory = Path(directory)
        return cls(directory, _open_directory(directory, follow=True), manifest)

    def close(self) -> None:
        """Release the directory. Local."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Save:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def arrays(self) -> list[dict]:
        """The manifest's array entries (mirrored, sync-on-read, plain arrays)."""
        return [e for e in self.manifest["entries"] if e["kind"] in ARRAY_KINDS]

    def open_entry(self, entry: dict) -> int:
        """Open an entry's data file, checking its type, size and ``.npy`` header; returns the descriptor. Local.

        Raises:
            ChecksumError: the file is missing, has another size than the
                manifest declares, or its header does not match its CRC-32.
            CheckpointError: it is not a regular file or cannot be read.
        """
        path = self.directory / entry["file"]
        try:
            fd = open_regular(self._fd, entry["file"], path)
        except FileNotFoundError:
            raise ChecksumError(
                f"{path}: data file of {entry['name']!r} is missing; the checkpoint is incomplete or was altered",
                file=str(path),
                entry=entry["name"],
            ) from None
        try:
            size, expected = os.fstat(fd).st_size, entry["data_offset"] + entry["nbytes"]
            if size != expected:
                raise ChecksumError(
                    f"{path}: data file of {entry['name']!r} has {size} bytes, expected {expected} "
                    "(truncated or extended after it was written)",
                    file=str(path),
                    entry=entry["name"],
                )
            header = bytearray(entry["data_offset"])
            if pread_into(fd, memoryview(header), 0) < len(header) or zlib.crc32(header) != entry["header_crc32"]:
                raise ChecksumError(
                    f"{path}: the .npy header of {entry['name']!r} does not match its checksum "
                    "(the file was altered or damaged after it was written)",
                    file=str(path),
                    entry=entry["name"],
                )
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise _unreadable(path, exc) from None
            raise
        return fd

    def check(self, entries: list[dict]) -> None:
        """Check every entry's data file (type, size, header) without reading its data. Local."""
        for entry in entries:
            os.close(self.open_entry(entry))

    def read(self, pieces: list[Piece], threads: int, verify: bool = True) -> None:
        """Read each piece into ``piece.buffer``, with ``verify`` checking each block's CRC-32. Local.

        A piece without a buffer gets a new one. Every file is opened and its
        size checked before any buffer is allocated. Raises like
        :meth:`open_entry`, and :class:`ChecksumError` for a block that does
        not match its CRC-32.
        """
        fds: dict[str, int] = {}
        try:
            for piece in pieces:
                if piece.entry["file"] not in fds:
                    fds[piece.entry["file"]] = self.open_entry(piece.entry)
            tasks = []
            for piece in pieces:
                if piece.buffer is None:
                    piece.buffer = np.empty(piece.hi - piece.lo, np.uint8)
                tasks += self._block_tasks(fds[piece.entry["file"]], piece, verify)
            run_tasks(tasks, threads)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _block_tasks(self, fd: int, piece: Piece, verify: bool) -> list[Any]:
        block, entry = self.manifest[BLOCK_BYTES_KEY], piece.entry
        path, view = self.directory / entry["file"], memoryview(piece.buffer)
        return [
            lambda lo=lo: _read_block(
                fd, view[lo - piece.lo : min(lo + block, piece.hi) - piece.lo], lo, entry, path, block, verify
            )
            for lo in range(piece.lo, piece.hi, block)
        ]

    def verify_entry(self, entry: dict, threads: int) -> None:
        """Check an entry's file and every block's CRC-32, holding only ``threads`` blocks in memory. Local."""
        fd = self.open_entry(entry)
        try:
            step = self.manifest[BLOCK_BYTES_KEY] * threads
            buffer = np.empty(min(step, entry["nbytes"]), np.uint8)
            for lo in range(0, entry["nbytes"], step):
                piece = Piece(entry, lo, min(lo + step, entry["nbytes"]), buffer[: min(step, entry["nbytes"] - lo)])
                run_tasks(self._block_tasks(fd, piece, True), threads)
        finally:
            os.close(fd)


def _read_manifest(fd: int, directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        manifest_fd = open_regular(fd, MANIFEST, path)
    except FileNotFoundError:
        raise ChecksumError(
            f"{path} is missing: the save was damaged or altered after it was committed (a save "
            f"appears only with its manifest); pass an older {VERSION_PREFIX}NNNNNN inside "
            f"{directory.parent} to go back to it"
        ) from None
    try:
        size = os.fstat(manifest_fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"{path}: the manifest has {size} bytes, more than the {MAX_MANIFEST_BYTES} a "
                "reader accepts; this is not a manifest written by mpidist"
            )
        data = bytearray(size)
        got = pread_into(manifest_fd, memoryview(data), 0)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    finally:
        os.close(manifest_fd)
    return decode_manifest(bytes(data[:got]), str(path))


def _read_block(fd: int, out: memoryview, lo: int, entry: dict, path: Path, block_bytes: int, verify: bool) -> None:
    try:
        got = pread_into(fd, out, entry["data_offset"] + lo)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    index = lo // block_bytes
    where = f"{path}: {entry['name']!r}, bytes {lo}-{lo + len(out)} (block {index})"
    if got < len(out):
        raise ChecksumError(
            f"{where}: the file ends after {entry['data_offset'] + lo + got} bytes; it was "
            "truncated after it was written",
            file=str(path),
            entry=entry["name"],
        )
    if verify:
        expected, found = entry[BLOCK_CRCS_KEY][index], zlib.crc32(out)
        if found != expected:
            raise ChecksumError(
                f"{where}: CRC-32 {found:08x} does not match the recorded {expected:08x}; the "
                "file was altered or damaged after it was written",
                file=str(path),
                entry=entry["name"],
            )


def read_checkpoint(path: PathLike, *, verify: bool = True) -> dict[str, np.ndarray]:
    """Read a checkpoint into plain NumPy arrays, without MPI or a strategy. Local.

    Args:
        path: a checkpoint directory (its newest save is read) or one save
            inside it (``path/ckpt-000003``).
        verify: check the CRC-32 of every block of data (default). Without
            it, the manifest, the type, size and ``.npy`` header of every
            data file are still checked; only the data's checksums are not
            computed.

    Returns:
        ``{name: array}`` for every array entry: a mirrored variable's value,
        a sync-on-read variable's reduced value, a plain array (of
        ``ml_dtypes.bfloat16`` for a bfloat16 entry). Iterator states are not
        arrays; they are in the manifest's JSON.

    Raises:
        FileNotFoundError: no complete save at ``path``.
        ChecksumError: a file is damaged; the message names it and the entry.
        CheckpointError: the save is malformed or unreadable (a manifest that
            asks for what a reader refuses, a link, FIFO or device inside the
            save); the message names the file.
        TypeError: an entry is bfloat16 and ml_dtypes is not installed.
    """
    with Save.open(path) as save:
        dtypes = [memory_dtype(e) for e in save.arrays]  # before reading: bfloat16 needs ml_dtypes
        pieces = [Piece(e, 0, e["nbytes"]) for e in save.arrays]
        save.read(pieces, io_threads(), verify=verify)
    return {p.entry["name"]: entry_array(p.entry, p.buffer, dtype) for p, dtype in zip(pieces, dtypes)}


@dataclasses.dataclass
class Report:
    """What :func:`inspect` found in one save."""

    directory: Path
    manifest: dict
    problems: dict[str, str]  # entry name -> what is wrong with it (empty: all checked and fine)
    verified: bool
    unreadable: bool = False  # some problem is not damage but a file a reader refuses or cannot read

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> int:
        """0 all fine, 1 damaged data (checksum or size), 3 unreadable files."""
        return 0 if self.ok else 3 if self.unreadable else 1


def inspect(path: PathLike, *, verify: bool = True) -> Report:
    """Describe one save and check it, collecting every entry's problem. Local.

    Every data file's type, size and header are checked; with ``verify``
    also every block's CRC-32 (which reads all the data).

    Raises:
        FileNotFoundError: no complete save at ``path``.
        ChecksumError: the manifest itself is damaged.
        CheckpointError: the manifest is malformed or cannot be read.
    """
    threads = io_threads()
    with Save.open(path) as save:
        problems: dict[str, str] = {}
        unreadable = False
        for entry in save.arrays:
            try:
                if verify:
                    save.verify_entry(entry, threads)
                else:
                    save.check([entry])
            except CheckpointError as exc:
                problems[entry["name"]] = str(exc)
                unreadable = unreadable or not isinstance(exc, ChecksumError)
        return Report(save.directory, save.manifest, problems, verify, unreadable)
