"""Memory dock: one map per GPU and one for host RAM, by component, predicted beside measured.

Each map is two stacked bars drawn with QPainter on the tier's capacity: "predicted" (the memory
model's bytes by component, plus what other processes use now, plus free) and "measured" (used by
all processes and free, from NVML / psutil). A tier over its budget is framed red with the reason.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QLabel, QScrollArea, QSizePolicy, QVBoxLayout, QWidget

from workbench.core.fmt import bytes2human
from workbench.session import Prediction, Session

from .bridge import connect_gui

COMPONENTS = (
    ("dense/attention", "#4aa3ff", ("embed", "attn", "router", "dense_mlp", "norm", "lm_head")),
    ("shared experts", "#9b7bff", ("shared",)),
    ("routed experts", "#37d67a", ("expert",)),
)
KV_COLOUR, RUNTIME_COLOUR, OTHERS_COLOUR, FREE_COLOUR = "#ffb020", "#8a8a99", "#c05050", "#2c2c34"


def predicted_segments(tier_memory, others: int) -> list[tuple[str, str, int]]:
    """(label, colour, bytes) of a tier's predicted use, in drawing order; ``others`` = bytes other
    processes use now."""
    segs = [(label, colour, sum(tier_memory.weights.get(k, 0) for k in kinds)) for label, colour, kinds in COMPONENTS]
    segs.append(("KV cache", KV_COLOUR, tier_memory.kv_cache))
    segs.append(("runtime + stream cache", RUNTIME_COLOUR, tier_memory.overhead + tier_memory.stream_cache))
    segs.append(("other processes", OTHERS_COLOUR, others))
    return segs


class TierMap(QWidget):
    """The map of one tier. ``update_from(session, prediction)`` sets what it draws."""

    BAR_H = 18

    def __init__(self, tier: str, parent=None):
        super().__init__(parent)
        self.tier = tier
        self.capacity = 0
        self.predicted: list[tuple[str, str, int]] = []
        self.measured_used: int | None = None
        self.measured_ours = 0
        self.reason = ""
        self.title = tier
        self.subtitle = ""
        self.setMinimumHeight(3 * self.BAR_H + 46)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def update_from(self, session: Session, pred: Prediction) -> None:
        mem = pred.memory
        tm = mem.tiers.get(self.tier) if mem is not None else None
        measured = session.measured.get(self.tier)
        ours = session.engine_bytes().get(self.tier, 0)
        others = max(0, measured[0] - measured[1] - ours) if measured else 0
        self.predicted = predicted_segments(tm, others) if tm is not None else []
        predicted_total = sum(b for _, _, b in self.predicted)
        self.capacity = session.capacity(self.tier) or max(predicted_total, 1)
        self.measured_used = measured[0] - measured[1] if measured else None
        self.measured_ours = min(ours, self.measured_used) if measured else 0
        self.reason = pred.over.get(self.tier, "")
        name = "host RAM" if self.tier == "cpu" else self.tier.upper().replace(":", " ")
        if self.tier != "cpu" and session.hardware is not None:
            i = int(self.tier[4:])
            if i < len(session.hardware.gpus):
                name += f" · {session.hardware.gpus[i].name}"
        budget = pred.budgets.get(self.tier)
        self.title = name
        self.subtitle = (
            f"predicted {bytes2human(predicted_total - others)}"
            + (f" · budget {bytes2human(budget)}" if budget is not None else "")
            + (f" · capacity {bytes2human(self.capacity)}" if session.capacity(self.tier) else " · capacity unknown")
        )
        self.setToolTip(self.reason or "\n".join(f"{lbl}: {bytes2human(b)}" for lbl, _, b in self.predicted))
        self.update()

    def paintEvent(self, _ev) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        w = self.width() - 90
        over = bool(self.reason)
        p.setPen(QColor("#e05050") if over else self.palette().text().color())
        font = p.font()
        font.setBold(True)
        p.setFont(font)
        p.drawText(QRectF(4, 0, self.width() - 8, 16), Qt.AlignmentFlag.AlignLeft, self.title)
        font.setBold(False)
        p.setFont(font)
        p.drawText(QRectF(4, 16, self.width() - 8, 16), Qt.AlignmentFlag.AlignLeft, self.subtitle)
        y = 36
        for label, segs in (("predicted", self.predicted), ("measured", self._measured_segments())):
            p.setPen(self.palette().text().color())
            p.drawText(QRectF(4, y, 82, self.BAR_H), Qt.AlignmentFlag.AlignVCenter, label)
            x = 88.0
            p.fillRect(QRectF(x, y, w, self.BAR_H), QColor(FREE_COLOUR))
            for _, colour, nbytes in segs:
                dx = w * nbytes / self.capacity if self.capacity else 0
                p.fillRect(QRectF(x, y, min(dx, 88 + w - x), self.BAR_H), QColor(colour))
                x += dx
            if label == "measured" and self.measured_used is None:
                p.setPen(QColor("#8a8a99"))
                p.drawText(QRectF(94, y, w, self.BAR_H), Qt.AlignmentFlag.AlignVCenter, "not measured on this machine")
            if over and label == "predicted":
                p.setPen(QPen(QColor("#e05050"), 2))
                p.drawRect(QRectF(88, y, w, self.BAR_H))
            y += self.BAR_H + 4
        if over:
            p.setPen(QColor("#e05050"))
            p.drawText(QRectF(4, y, self.width() - 8, 16), Qt.AlignmentFlag.AlignLeft, "over budget: " + self.reason)
        p.end()

    def _measured_segments(self) -> list[tuple[str, str, int]]:
        if self.measured_used is None:
            return []
        return [("this engine", COMPONENTS[2][1], self.measured_ours),
                ("other processes", OTHERS_COLOUR, self.measured_used - self.measured_ours)]


class MemoryDock(QWidget):
    """All tier maps, rebuilt when the set of tiers changes."""

    def __init__(self, session: Session, parent=None):
        super().__init__(parent)
        self.session = session
        self.maps: dict[str, TierMap] = {}
        inner = QWidget()
        self._lay = QVBoxLayout(inner)
        self._lay.setContentsMargins(4, 4, 4, 4)
        self.legend = QLabel(" ".join(
            f"<span style='color:{c}'>■</span> {lbl}" for lbl, c in
            [(lbl, c) for lbl, c, _ in COMPONENTS] + [("KV cache", KV_COLOUR), ("runtime", RUNTIME_COLOUR),
                                                      ("other processes", OTHERS_COLOUR), ("free", "#55555f")]
        ))
        self.legend.setWordWrap(True)
        self.note = QLabel("")
        self.note.setWordWrap(True)
        self._lay.addWidget(self.legend)
        self._lay.addStretch(1)
        self._lay.addWidget(self.note)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)
        connect_gui(session.events.prediction_changed, self._on_prediction, self)

    def _on_prediction(self, pred: Prediction) -> None:
        tiers = self.session.tiers() if self.session.inventory is not None else []
        if list(self.maps) != tiers:
            for m in self.maps.values():
                m.deleteLater()
            self.maps = {}
            for i, tier in enumerate(tiers):
                m = TierMap(tier)
                self.maps[tier] = m
                self._lay.insertWidget(1 + i, m)
        for m in self.maps.values():
            m.update_from(self.session, pred)
        unmeasured = [t for t in tiers if t not in self.session.measured]
        self.note.setText(
            "" if not unmeasured else
            f"No live measurement for {', '.join(unmeasured)}: capacity from the hardware profile."
        )
