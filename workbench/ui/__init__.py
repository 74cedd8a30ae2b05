"""The window (PySide6 + pyqtgraph): views of the Session; no tensor math, no file parsing."""
