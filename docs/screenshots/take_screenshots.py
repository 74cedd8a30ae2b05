"""Take the README screenshots of the running window with the bundled demo model.

Run under Xvfb (needs ImageMagick's ``import``):

    xvfb-run -a -s "-screen 0 1600x1000x24" python docs/screenshots/take_screenshots.py

It opens the demo model, profiles routing on the calibration prompts, plans with the ``frequency``
strategy under a VRAM budget that holds about half of the routed experts, asks the model something,
and grabs the whole X screen after each step into docs/screenshots/*.png.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from workbench.core.placement import CPU_COMPUTE
    from workbench.ui.app import make_app
    from workbench.ui.main_window import MainWindow

    app = make_app()
    win = MainWindow()
    area = app.primaryScreen().availableGeometry()
    win.resize(area.width(), area.height())
    win.move(area.topLeft())
    win.show()
    win.start_hardware()
    s = win.session

    def wait(cond, timeout=120.0):
        t0 = time.monotonic()
        while not cond():
            app.processEvents()
            time.sleep(0.01)
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("step did not finish")

    def settle(seconds=1.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            app.processEvents()
            time.sleep(0.01)

    def shoot(name):
        settle(0.8)
        subprocess.run(["import", "-window", "root", str(HERE / name)], check=True)
        print("wrote", HERE / name)

    win.open_path(ROOT / "resources" / "demo")
    wait(lambda: s.inventory is not None and win.job is None)
    win.profile()
    wait(lambda: s.stats is not None and win.job is None)
    # a GPU budget that holds about half of the routed experts
    experts = s.inventory.expert_keys()
    half = sum(s.unit_bytes(k) for k in experts) // 2
    s.move_units(experts, CPU_COMPUTE)
    s.set_margin(s.capacity("gpu:0") - s.prediction().tier_total("gpu:0") - half)
    win.experts.apply_strategy("frequency")
    win.show_status("Profiled 36 calibration prompts; planned 'frequency' with half the experts' bytes of VRAM")
    shoot("workbench-experts.png")

    # a drag of CPU experts hovering the GPU lane: every lane shows the would-be figures, and
    # the GPU lane refuses because the budget would break
    from PySide6.QtCore import QPoint, Qt
    from PySide6.QtGui import QDragEnterEvent, QDragLeaveEvent
    from PySide6.QtWidgets import QApplication

    grid = win.experts.grid
    cpu_cells = [(r, c) for r, c in zip(*(s.tier_grid() == 0).nonzero())][:6]
    grid.select_cells([(int(r), int(c)) for r, c in cpu_cells])
    lane = win.experts.lanes["gpu:0"]
    mime = grid.drag_mime()
    enter = QDragEnterEvent(QPoint(10, 10), Qt.DropAction.MoveAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(lane, enter)
    shoot("workbench-drag-refused.png")
    QApplication.sendEvent(lane, QDragLeaveEvent())
    grid.clear_selection()

    s.set_chat_settings(sampling={"temperature": 0.7, "max_new": 120, "seed": 3})
    for question in ("Tell me about the ball at Netherfield.", "What did Mr. Darcy say to Elizabeth?"):
        win.chat_dock.input.setPlainText(question)
        win.chat_dock.send()
        wait(lambda: win.chat_dock.busy)
        wait(lambda: not win.chat_dock.busy and win.job is None)
    settle(1.5)
    shoot("workbench-chat.png")
    s.dirty = False
    win.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
