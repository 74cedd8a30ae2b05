"""Deliver session (psygnal) events to Qt slots on the GUI thread, whatever thread emitted them."""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal


class _Relay(QObject):
    fired = Signal(object)


def connect_gui(signal, slot, parent: QObject) -> None:
    """Connect psygnal ``signal`` to ``slot`` so that ``slot(*args)`` always runs on the thread of
    ``parent`` (the GUI thread). Emissions from the GUI thread run ``slot`` at once; emissions from a
    worker thread are queued. The connection lives as long as ``parent``."""
    relay = _Relay(parent)
    relay.fired.connect(lambda args: slot(*args), Qt.ConnectionType.AutoConnection)

    def forward(*args):
        try:
            relay.fired.emit(args)
        except RuntimeError:  # the widget was deleted
            signal.disconnect(forward)

    signal.connect(forward)
    parent.destroyed.connect(lambda *_: signal.disconnect(forward, missing_ok=True))
