"""The window (PySide6 + pyqtgraph). Importing it tops up the reference counts that the Qt bindings'
bug drains (see ``refguard``)."""

from . import refguard

refguard.top_up()
