"""Performance dock: live pyqtgraph plots from ring buffers at 10 Hz: decode tokens/s (measured,
with the prediction as a line), VRAM per GPU, host RAM, PCIe RX/TX, GPU utilisation."""

from __future__ import annotations

import math
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QVBoxLayout, QWidget

from workbench.session import Session

from .bridge import connect_gui
from .heatmap import GPU_COLOURS

WINDOW_S = 120.0
"""Seconds of history shown."""

GIB = 2**30


class PerformanceDock(QWidget):
    """Reads ``session.sampler`` series and ``session.tokens_per_s_series()`` on a 10 Hz timer."""

    def __init__(self, session: Session, parent=None):
        super().__init__(parent)
        self.session = session
        self.layout_widget = pg.GraphicsLayoutWidget()
        self.layout_widget.setBackground("#1e1e24")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.layout_widget)
        self.plots: dict[str, pg.PlotItem] = {}
        titles = (("tps", "decode tokens/s"), ("vram", "VRAM GiB"), ("ram", "host RAM GiB"),
                  ("pcie", "PCIe MB/s (RX solid, TX dashed)"), ("util", "GPU util %"))
        for i, (key, title) in enumerate(titles):
            p = self.layout_widget.addPlot(row=0, col=i, title=title)
            p.setDownsampling(mode="peak")
            p.setClipToView(True)
            p.showGrid(x=False, y=True, alpha=0.2)
            p.setLabel("bottom", "seconds ago")
            p.setMouseEnabled(x=False, y=False)
            p.enableAutoRange(x=False, y=True)
            p.hideButtons()
            p.setXRange(-WINDOW_S, 0, padding=0)
            self.plots[key] = p
        self.tps_curve = self.plots["tps"].plot(pen=pg.mkPen("#37d67a", width=2), symbol="o", symbolSize=3)
        self.tps_pred = pg.InfiniteLine(angle=0, pen=pg.mkPen("#ffb020", style=pg.QtCore.Qt.PenStyle.DashLine))
        self.plots["tps"].addItem(self.tps_pred, ignoreBounds=True)
        self.tps_pred.hide()
        self.ram_curve = self.plots["ram"].plot(pen=pg.mkPen("#4aa3ff", width=2))
        self.ram_total = pg.InfiniteLine(angle=0, pen=pg.mkPen("#c05050", style=pg.QtCore.Qt.PenStyle.DotLine))
        self.plots["ram"].addItem(self.ram_total)
        self.gpu_curves: dict[str, list] = {"vram": [], "pcie_rx": [], "pcie_tx": [], "util": []}
        self.no_gpu_text: list[pg.TextItem] = []
        self._made_gpu_curves = False
        self.timer = QTimer(self)
        self.timer.setInterval(100)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        connect_gui(session.events.prediction_changed, self._on_prediction, self)

    def _on_prediction(self, pred) -> None:
        if pred is None or math.isnan(pred.decode_tps):
            self.tps_pred.hide()
        else:
            self.tps_pred.setValue(pred.decode_tps)
            self.tps_pred.show()
            hw = self.session.hardware.name if self.session.hardware is not None else "?"
            self.plots["tps"].setTitle(f"decode tok/s · predicted {pred.decode_tps:.0f} (dashed)")
            self.plots["tps"].titleLabel.setToolTip(f"prediction for {hw}")

    def _make_gpu_curves(self, n_gpus: int) -> None:
        self._made_gpu_curves = True
        for i in range(n_gpus):
            c = GPU_COLOURS[i % len(GPU_COLOURS)]
            self.gpu_curves["vram"].append(self.plots["vram"].plot(pen=pg.mkPen(c, width=2)))
            self.gpu_curves["pcie_rx"].append(self.plots["pcie"].plot(pen=pg.mkPen(c, width=2)))
            self.gpu_curves["pcie_tx"].append(
                self.plots["pcie"].plot(pen=pg.mkPen(c, width=1, style=pg.QtCore.Qt.PenStyle.DashLine)))
            self.gpu_curves["util"].append(self.plots["util"].plot(pen=pg.mkPen(c, width=2)))
        if n_gpus == 0:
            for key in ("vram", "pcie", "util"):
                t = pg.TextItem("no GPU visible (NVML)", color="#ffb020", anchor=(0.5, 0.5))
                self.plots[key].addItem(t)
                t.setPos(-WINDOW_S / 2, 0)
                self.no_gpu_text.append(t)

    def refresh(self) -> None:
        """Redraw every curve from the ring buffers (10 Hz)."""
        if not self.isVisible():
            return
        s = self.session
        sampler = s.sampler
        now = time.monotonic()
        t, tps = s.tokens_per_s_series()
        if len(t):
            keep = t > now - WINDOW_S
            self.tps_curve.setData(t[keep] - now, tps[keep])
        if sampler is None:
            return
        if not self._made_gpu_curves:
            self._make_gpu_curves(sampler.n_gpus)
        ts, used = sampler.series("ram_used")
        if not len(ts):
            return
        x = ts - ts[-1]
        keep = x > -WINDOW_S
        self.ram_curve.setData(x[keep], used[keep] / GIB)
        _, total = sampler.series("ram_total")
        if len(total) and np.isfinite(total[-1]):
            self.ram_total.setValue(total[-1] / GIB)
        for i in range(sampler.n_gpus):
            for key, field, scale in (("vram", "memory_used", 1 / GIB), ("pcie_rx", "pcie_rx", 1e-6),
                                      ("pcie_tx", "pcie_tx", 1e-6), ("util", "util_gpu", 1.0)):
                _, v = sampler.series(field, gpu=i)
                self.gpu_curves[key][i].setData(x[keep], v[keep] * scale)
