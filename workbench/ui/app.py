"""Start the window: ``run(path)`` builds the QApplication, the Session and the MainWindow."""

from __future__ import annotations

import sys
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QThreadPool
from PySide6.QtWidgets import QApplication

from workbench.session import Session

from .main_window import MainWindow


def make_app() -> QApplication:
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("MoE Workbench")
    app.setOrganizationName("moe-workbench")
    pg.setConfigOptions(antialias=False, imageAxisOrder="row-major")
    pool = QThreadPool.globalInstance()  # superqt workers run here; Qt sizes it by the core count
    pool.setMaxThreadCount(max(pool.maxThreadCount(), 8))
    return app


def run(path: str | Path | None = None) -> int:
    """Open the window on ``path`` (model folder, .gguf or project .json) or on nothing."""
    app = make_app()
    win = MainWindow(Session())
    screen = app.primaryScreen()
    if screen is not None:
        area = screen.availableGeometry()
        win.resize(min(win.width(), area.width()), min(win.height(), area.height()))
        win.move(area.topLeft())
    win.show()
    win.start_hardware()
    if path is not None:
        win.open_path(path)
    return app.exec()
