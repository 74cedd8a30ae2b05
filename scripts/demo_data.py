"""Training text for the bundled demo model: Jane Austen's six novels from Debian's r-cran-janeaustenr.

The novels (Project Gutenberg transcriptions, public domain) ship in that Debian package as an R
lazy-load database (``data/Rdata.rdb`` + ``Rdata.rdx``). R itself is not needed: the package is
fetched with ``apt-get download r-cran-janeaustenr`` (no dependencies installed), unpacked with
``dpkg-deb -x``, and the database is decoded by the small reader of R's XDR serialisation below
(character vectors, lists, pairlists, attributes; anything else is refused). Nothing is unpickled.

    apt-get update && apt-get download r-cran-janeaustenr   # what ``locate_package`` runs
"""

from __future__ import annotations

import gzip
import logging
import shutil
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

DEB_NAME = "r-cran-janeaustenr"
INSTALLED_DIR = Path("/usr/lib/R/site-library/janeaustenr")
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
"""Object names in the package's data database, in publication order."""

_NIL, _REF, _GLOBALENV, _EMPTYENV, _BASEENV, _MISSING = 254, 255, 253, 242, 241, 251
_CHARSXP, _LGLSXP, _INTSXP, _REALSXP, _STRSXP, _VECSXP, _LISTSXP, _SYMSXP = 9, 10, 13, 14, 16, 19, 2, 1


class _XdrReader:
    """Decode one R object serialised in XDR format ("X\\n" header) from bytes."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialisation")
        self.data = data
        self.pos = 2
        self.refs: list[object] = []
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal R version to read it
        if version == 3:
            name_length = self.int()
            self.pos += name_length  # native encoding name

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def read(self) -> object:
        flags = self.int()
        kind = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in (_NIL, _GLOBALENV, _EMPTYENV, _BASEENV, _MISSING):
            return None
        if kind == _REF:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == _SYMSXP:
            name = self.read()
            self.refs.append(name)
            return name
        if kind == _CHARSXP:
            length = self.int()
            if length == -1:
                return None
            text = self.data[self.pos : self.pos + length].decode("utf-8", errors="replace")
            self.pos += length
            return text
        if kind == _LISTSXP:
            items: dict[object, object] = {}
            while True:
                attrs = self.read() if has_attr else None
                del attrs
                tag = self.read() if has_tag else len(items)
                items[tag] = self.read()
                flags = self.int()
                if flags & 0xFF == _NIL:
                    return items
                has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
                if flags & 0xFF != _LISTSXP:
                    raise ValueError(f"unsupported pairlist tail type {flags & 0xFF}")
        value: object
        if kind in (_STRSXP, _VECSXP):
            value = [self.read() for _ in range(self.int())]
        elif kind in (_LGLSXP, _INTSXP):
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == _REALSXP:
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attrs = self.read()
            names = attrs.get("names") if isinstance(attrs, dict) else None
            if kind == _VECSXP and names is not None:
                value = dict(zip(names, value))
        return value


def read_lazyload_db(directory: Path, stem: str = "Rdata") -> dict[str, object]:
    """Read every object of an R lazy-load database ``{stem}.rdx`` + ``{stem}.rdb`` in ``directory``.

    Returns name -> decoded value (a character vector decodes to ``list[str | None]``).
    """
    index = _XdrReader(gzip.decompress((directory / f"{stem}.rdx").read_bytes())).read()
    if not isinstance(index, dict) or "variables" not in index:
        raise ValueError("unexpected lazy-load index layout")
    blob = (directory / f"{stem}.rdb").read_bytes()
    objects: dict[str, object] = {}
    for name, (offset, length) in index["variables"].items():
        record = blob[int(offset) : int(offset) + int(length)]
        objects[name] = _XdrReader(zlib.decompress(record[4:])).read()
    return objects


def locate_package(cache_dir: Path) -> Path:
    """Return the janeaustenr package directory, installed or unpacked from the .deb into ``cache_dir``."""
    if (INSTALLED_DIR / "data" / "Rdata.rdb").exists():
        return INSTALLED_DIR
    unpacked = cache_dir / "deb" / INSTALLED_DIR.relative_to("/")
    if (unpacked / "data" / "Rdata.rdb").exists():
        return unpacked
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        log.info("fetching %s with apt-get download", DEB_NAME)
        # apt drops privileges to _apt, which must be able to write the download folder.
        Path(tmp).chmod(0o777)
        subprocess.run(["apt-get", "download", DEB_NAME], cwd=tmp, check=True)
        (deb,) = Path(tmp).glob(f"{DEB_NAME}_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(cache_dir / "deb")], check=True)
        shutil.copy(deb, cache_dir / deb.name)
    return unpacked


def novel_paragraphs(lines: list[str | None]) -> list[str]:
    """Join a novel's text lines into paragraphs (blank-line separated), one string per paragraph."""
    paragraphs, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return [p.replace("_", "") for p in paragraphs]


def load_novels(cache_dir: Path) -> dict[str, list[str]]:
    """Return novel name -> list of paragraphs, for the six novels in publication order."""
    objects = read_lazyload_db(locate_package(cache_dir) / "data")
    missing = [n for n in NOVELS if n not in objects]
    if missing:
        raise ValueError(f"janeaustenr data lacks {missing}; has {sorted(objects)}")
    return {name: novel_paragraphs(objects[name]) for name in NOVELS}
