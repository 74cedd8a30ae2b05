"""Device lanes: one drop target per GPU and one for the CPU, under the experts grid.

A lane accepts the units MIME payload. While a drag hovers over it, it shows what the placement
would cost with the units moved there (VRAM of that tier, decode tokens/s); a drop that would break
a budget is refused with the reason.
"""

from __future__ import annotations

import math

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from workbench.core.fmt import bytes2human
from workbench.core.placement import CPU, Assignment
from workbench.session import Prediction, Session

from .heatmap import CPU_COLOUR, GPU_COLOURS
from .mime import units_from_mime


def tps_text(tps: float) -> str:
    return "—" if tps is None or math.isnan(tps) else f"{tps:.1f} tok/s"


class Lane(QWidget):
    """Drop target for tier ``tier``. ``dropped(keys, assignment)`` asks the panel to move units;
    ``hover_prediction(text, refused)`` reports the would-be prediction during a drag;
    ``hover_changed(prediction, keys, assignment)`` gives it to the panel (None when the drag left)."""

    dropped = Signal(object, object)
    hover_prediction = Signal(str, bool)
    hover_changed = Signal(object, object, object)

    def __init__(self, session: Session, tier: str, parent=None):
        super().__init__(parent)
        self.session = session
        self.tier = tier
        self.assignment = Assignment(tier, "compute") if tier == CPU else Assignment(tier)
        self.setAcceptDrops(True)
        self.setMinimumHeight(46)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.colour = QColor(CPU_COLOUR if tier == CPU else GPU_COLOURS[int(tier[4:]) % len(GPU_COLOURS)])
        self.line1 = ""
        self.line2 = ""
        self.hover_text = ""
        self.refused_reason = ""
        self.refused_reason_hover = ""
        self._hover_keys = None

    def title(self) -> str:
        return "CPU (RAM)" if self.tier == CPU else self.tier.upper().replace(":", " ")

    def show_prediction(self, pred: Prediction, n_experts: int) -> None:
        total = pred.tier_total(self.tier)
        budget = pred.budgets.get(self.tier)
        mem = bytes2human(total) if total is not None else "?"
        mem += f" / {bytes2human(budget)}" if budget is not None else ""
        self.line1 = f"{self.title()} · {n_experts} experts"
        self.line2 = f"{mem} · decode {tps_text(pred.decode_tps)}"
        self.refused_reason = pred.over.get(self.tier, "")
        self.update()

    # -- drag and drop --------------------------------------------------------------------------

    def _payload(self, event):
        got = units_from_mime(event.mimeData())
        if got is None or self.session.inventory is None:
            return None
        keys, fingerprint = got
        if fingerprint != (self.session.inventory.fingerprint or ""):
            return None
        return keys

    def dragEnterEvent(self, event) -> None:
        keys = self._payload(event)
        if keys is None:
            event.ignore()
            return
        self._hover_keys = keys
        self._predict_hover(keys)
        event.acceptProposedAction()

    def dragMoveEvent(self, event) -> None:
        if self._hover_keys is None:
            event.ignore()
            return
        if self.refused_reason_hover:
            event.ignore()
        else:
            event.acceptProposedAction()

    def dragLeaveEvent(self, event) -> None:
        self._hover_keys = None
        self.hover_text = ""
        self.refused_reason_hover = ""
        self.hover_changed.emit(None, None, None)
        self.update()

    def dropEvent(self, event) -> None:
        keys = self._payload(event)
        self.dragLeaveEvent(event)
        if keys is None:
            event.ignore()
            return
        event.acceptProposedAction()
        self.dropped.emit(keys, self.assignment)

    def _predict_hover(self, keys) -> None:
        pred, reason = self.session.check_move(keys, self.assignment)
        total = pred.tier_total(self.tier)
        self.refused_reason_hover = reason
        self.hover_text = (
            f"drop {len(keys)} → {self.title()}: {bytes2human(total) if total is not None else '?'}"
            f" · decode {tps_text(pred.decode_tps)}"
        )
        if reason:
            self.hover_text = f"refused: {reason}"
        self.setToolTip(self.hover_text)
        self.hover_prediction.emit(self.hover_text, bool(reason))
        self.hover_changed.emit(pred, keys, self.assignment)
        self.update()

    def paintEvent(self, _ev) -> None:
        p = QPainter(self)
        r = self.rect().adjusted(1, 1, -2, -2)
        hovering = self._hover_keys is not None
        bad = bool(self.refused_reason_hover) if hovering else bool(self.refused_reason)
        fill = QColor(self.colour)
        fill.setAlpha(110 if hovering else 45)
        p.fillRect(r, fill)
        p.setPen(QPen(QColor("#e05050") if bad else self.colour, 3 if hovering else 2))
        p.drawRoundedRect(r, 5, 5)
        p.setPen(self.palette().text().color())
        text = self.hover_text if hovering else f"{self.line1}\n{self.line2}"
        p.drawText(r.adjusted(8, 2, -4, -2), Qt.AlignmentFlag.AlignVCenter | Qt.TextFlag.TextWordWrap, text)
        p.end()
