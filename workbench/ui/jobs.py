"""Long jobs off the GUI thread, with progress and cancel (superqt workers)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal
from superqt.utils import create_worker

log = logging.getLogger(__name__)


class Job(QObject):
    """One blocking function run in a worker thread.

    ``fn(progress, cancel)`` gets ``progress(fraction, message)`` (call it from the worker, any
    rate: it is throttled to ~20 Hz) and a ``threading.Event`` that Cancel sets. ``finished(result,
    error)`` is emitted on the GUI thread; ``error`` is the exception or None."""

    progressed = Signal(float, str)
    finished = Signal(object, object)

    def __init__(self, name: str, fn: Callable, parent=None):
        super().__init__(parent)
        self.name = name
        self.cancel = threading.Event()
        self._fn = fn
        self._last = 0.0
        self.worker = create_worker(self._run, _start_thread=False)
        self.worker.returned.connect(self._done)
        self.worker.errored.connect(lambda e: self.finished.emit(None, e))

    def _progress(self, fraction: float, message: str = "") -> None:
        now = time.monotonic()
        if now - self._last >= 0.05 or fraction >= 1.0:
            self._last = now
            self.progressed.emit(float(fraction), str(message))

    def _run(self):
        return self._fn(self._progress, self.cancel)

    def _done(self, result) -> None:
        self.finished.emit(result, None)

    def start(self) -> Job:
        self.worker.start()
        return self

    @property
    def running(self) -> bool:
        return bool(self.worker.is_running)
