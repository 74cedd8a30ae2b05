"""Keep None, True and False alive under a reference-count bug of the Qt bindings.

With PySide6 6.12 on CPython 3.11, many binding calls give back ``None`` (void methods) or ``True``
(``Signal.emit``) without the reference they owe, so the count of those singletons drops by one per
call; after some tens of thousands of calls Python aborts with "deallocating None". From CPython
3.12 on these objects are immortal and the bug is harmless. On older versions this module raises
their counts well above any reachable floor once, and again whenever they fall under it (checked a
few times per second): the singletons are never freed anyway, so an over-count costs nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

FLOOR = 1 << 24
"""Counts are kept above this (16.7 M: hours of the leak at its worst measured rate)."""

NEEDED = platform.python_implementation() == "CPython" and sys.version_info < (3, 12)

_SINGLETONS = (None, True, False)


def top_up() -> int:
    """Raise the count of each singleton below ``FLOOR`` by ``FLOOR``; returns how many were raised."""
    if not NEEDED:
        return 0
    raised = 0
    for obj in _SINGLETONS:
        count = ctypes.c_ssize_t.from_address(id(obj))  # ob_refcnt, the first field of PyObject
        if count.value < FLOOR:
            count.value += FLOOR
            raised += 1
    return raised


def install(parent) -> None:
    """Top up now and every 250 ms from a QTimer owned by ``parent`` (the QApplication)."""
    if not NEEDED:
        return
    from PySide6.QtCore import QTimer

    top_up()
    timer = QTimer(parent)
    timer.setInterval(250)
    timer.timeout.connect(top_up)
    timer.start()
    parent._workbench_refguard = timer
