"""The window survives the Qt bindings' reference-count bug (see workbench.ui.refguard)."""

from __future__ import annotations

import subprocess
import sys

from workbench.ui import refguard

SCRIPT = """
import sys
from workbench.ui.app import make_app
from PySide6.QtWidgets import QLabel
app = make_app()
label = QLabel()
for i in range(60000):  # each call may drop a reference to None; 60k is past where Python aborts
    label.setText(str(i % 7))
    if i % 5000 == 0:
        app.processEvents()
print("alive")
"""


def test_many_binding_calls_do_not_abort_python():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "alive" in out.stdout


def test_top_up_keeps_the_singletons_above_the_floor():
    refguard.top_up()
    if refguard.NEEDED:
        assert sys.getrefcount(None) > refguard.FLOOR and sys.getrefcount(True) > refguard.FLOOR
    else:
        assert refguard.top_up() == 0
