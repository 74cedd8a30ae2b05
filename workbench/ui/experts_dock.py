"""Experts panel: the heatmap, the device lanes, planner strategies and placement keys.

Every edit is pushed on the window's QUndoStack as a command that calls Session methods."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from workbench.core.errors import WorkbenchError
from workbench.core.fmt import bytes2human
from workbench.core.placement import CPU_COMPUTE, CPU_STREAM, Assignment
from workbench.core.units import UnitKey
from workbench.session import Session, code_assignment, tier_code
from workbench.session.services import STRATEGIES

from .bridge import connect_gui
from .heatmap import FREQ_CMAP, FREQ_MAX, ExpertGrid, tier_colour
from .lanes import Lane
from .mime import units_to_mime
from .undo import MoveUnits, SetPlacement, push_checked


class ExpertsDock(QWidget):
    """``status(text, is_error)`` is called to report refusals and results (the status bar)."""

    def __init__(self, session: Session, undo_stack, status=None, parent=None):
        super().__init__(parent)
        self.session = session
        self.undo_stack = undo_stack
        self.status = status or (lambda text, error=False: None)
        self.grid = ExpertGrid()
        self.grid.drag_mime = self._selection_mime
        self.grid.tooltip_for = self.cell_tooltip
        self.grid.context_menu_requested.connect(self._context_menu)
        self.grid.selection_changed.connect(self._on_selection)
        self.lanes: dict[str, Lane] = {}
        self._lanes_box = QHBoxLayout()
        self.selection_label = QLabel("")
        self.selection_label.setWordWrap(True)
        self.selection_label.setMinimumWidth(10)
        self.legend = QLabel("")
        self.legend.setWordWrap(True)
        self.legend.setMinimumWidth(10)
        self.legend.setTextFormat(Qt.TextFormat.RichText)

        top = QHBoxLayout()
        top.addWidget(QLabel("Plan:"))
        self.plan_buttons: dict[str, QPushButton] = {}
        for name in STRATEGIES:
            b = QPushButton(name)
            b.setToolTip(f"Place every unit with the '{name}' strategy under the budgets (undoable)")
            b.clicked.connect(lambda _=False, n=name: self.apply_strategy(n))
            top.addWidget(b)
            self.plan_buttons[name] = b
        top.addStretch(1)
        top.addWidget(QLabel("margin"))
        self.margin = QDoubleSpinBox()
        self.margin.setRange(0, 4096)
        self.margin.setDecimals(2)
        self.margin.setSuffix(" GiB")
        self.margin.setValue(session.margin / 2**30)
        self.margin.setToolTip("Memory kept free on every device; budgets are free memory minus this")
        self.margin.valueChanged.connect(lambda v: self.session.set_margin(int(v * 2**30)))
        top.addWidget(self.margin)
        self.live = QCheckBox("live routing")
        self.live.setChecked(True)
        self.live.setToolTip("While the model answers, colour the grid by the engine's routing counts")
        self.live.toggled.connect(session.set_live_view)
        top.addWidget(self.live)

        lay = QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addLayout(top)
        lay.addWidget(self.grid, 1)
        lay.addWidget(self.legend)
        lay.addWidget(self.selection_label)
        lay.addLayout(self._lanes_box)
        self._make_actions()

        ev = session.events
        connect_gui(ev.model_opened, lambda _inv: self._on_stats(), self)
        connect_gui(ev.placement_changed, lambda _p: self.redraw(), self)
        connect_gui(ev.stats_changed, lambda _s: self._on_stats(), self)
        connect_gui(ev.prediction_changed, self._on_prediction, self)
        connect_gui(ev.hardware_changed, lambda _h: self._build_lanes(), self)
        connect_gui(ev.settings_changed, self._on_settings, self)
        self._update_legend()

    def _on_settings(self) -> None:
        value = self.session.margin / 2**30
        if abs(self.margin.value() - value) > 1e-3:
            self.margin.blockSignals(True)
            self.margin.setValue(value)
            self.margin.blockSignals(False)

    # -- drawing ---------------------------------------------------------------------------------

    def redraw(self) -> None:
        s = self.session
        if s.inventory is None:
            return
        self.grid.set_cells(s.frequency_grid(), s.tier_grid(), s.moe_layers)
        if list(self.lanes) != s.tiers():
            self._build_lanes()

    def _build_lanes(self) -> None:
        for lane in self.lanes.values():
            lane.deleteLater()
        self.lanes = {}
        for tier in self.session.tiers():
            lane = Lane(self.session, tier)
            lane.dropped.connect(self.move)
            lane.hover_prediction.connect(lambda text, bad: self.status(text, bad))
            lane.hover_changed.connect(self._on_hover)
            self._lanes_box.addWidget(lane)
            self.lanes[tier] = lane
        self._on_prediction(self.session.prediction())
        self._update_legend()

    def _on_hover(self, pred, keys, assignment) -> None:
        """While a drag hovers a lane, every lane shows the would-be placement's figures."""
        if pred is None:
            self._on_prediction(self.session.prediction())
            return
        grid = self.session.tier_grid().copy()
        row_of = {layer: i for i, layer in enumerate(self.session.moe_layers)}
        code = tier_code(assignment)
        for k in keys:
            if k.kind == "expert" and k.layer in row_of:
                grid[row_of[k.layer], k.expert] = code
        self._on_prediction(pred, grid)

    def _on_prediction(self, pred, grid=None) -> None:
        if self.session.inventory is None:
            return
        grid = self.session.tier_grid() if grid is None else grid
        for tier, lane in self.lanes.items():
            codes = [c for c in np.unique(grid) if code_assignment(int(c)).tier == tier]
            n = int(np.isin(grid, codes).sum()) if codes else 0
            lane.show_prediction(pred, n)

    def _update_legend(self) -> None:
        stops = " ".join(
            f"<span style='color:{FREQ_CMAP.map(np.sqrt(v / FREQ_MAX), mode='qcolor').name()}'>■</span>{v:g}×"
            for v in (0, 0.5, 1, 2, 3)
        )
        tiers = " ".join(
            f"<span style='color:{tier_colour(c)}'>□</span>{code_assignment(c)}"
            for c in sorted({1, 0} | {2 + i for i in range(len(self.session.tiers()) - 1)})
        )
        self.legend.setText(f"colour = routing frequency (× the layer's average): {stops} &nbsp;·&nbsp; "
                            f"frame = tier: {tiers}")

    def cell_tooltip(self, row: int, expert: int) -> str:
        s = self.session
        layer = s.moe_layers[row]
        key = UnitKey(layer, "expert", expert)
        freq = s.frequency_grid()[row, expert]
        if s.stats is not None:
            counts = s.stats.counts[layer]
            share = counts[expert] / counts.sum() if counts.sum() else float("nan")
            ftxt = f"{share:.2%} of layer {layer}'s lookups ({freq:.2f}× average, {int(counts[expert])} picks, {s.stats_source})"
        else:
            ftxt = "not profiled yet (Run ▸ Profile)"
        return (f"layer {layer} · expert {expert}\n{bytes2human(s.unit_bytes(key))}\n"
                f"frequency: {ftxt}\ntier: {s.placement.get(key)}")

    # -- selection and edits -----------------------------------------------------------------------

    def selected_keys(self) -> list[UnitKey]:
        layers = self.session.moe_layers
        return [UnitKey(layers[r], "expert", e) for r, e in self.grid.selected_cells()]

    def _selection_mime(self):
        return units_to_mime(self.selected_keys(), self.session.inventory.fingerprint or "")

    def _on_selection(self) -> None:
        keys = self.selected_keys()
        if not keys:
            self.selection_label.setText(self._idle_hint())
            return
        nbytes = sum(self.session.unit_bytes(k) for k in keys)
        self.selection_label.setText(f"{len(keys)} experts selected · {bytes2human(nbytes)} · drag onto a lane below")

    def _idle_hint(self) -> str:
        hint = "Select experts: click, drag a rectangle, click a layer number or double-click a row."
        if self.session.stats is None:
            hint = "No routing statistics yet: Run ▸ Profile (or chat) colours the grid. " + hint
        return hint

    def _on_stats(self) -> None:
        self.redraw()
        if not self.selected_keys():
            self.selection_label.setText(self._idle_hint())

    def move(self, keys: list[UnitKey], assignment: Assignment) -> bool:
        """Move ``keys`` as one undoable command; a budget refusal is reported and changes nothing."""
        if not keys:
            return False
        reason = push_checked(self.undo_stack, MoveUnits(self.session, keys, assignment))
        if reason:
            self.status(f"Refused: {reason}", True)
            return False
        pred = self.session.prediction()
        self.status(f"Moved {len(keys)} experts to {assignment} · decode {pred.decode_tps:.1f} tok/s", False)
        return True

    def move_selection(self, assignment: Assignment) -> bool:
        return self.move(self.selected_keys(), assignment)

    def apply_strategy(self, name: str) -> None:
        try:
            placement = self.session.plan(name)
        except WorkbenchError as e:
            self.status(f"{name}: {e}", True)
            return
        self.undo_stack.push(SetPlacement(self.session, placement, f"Plan: {name}"))
        self.status(f"Planned with {name}", False)

    def _make_actions(self) -> None:
        def act(text, keys, fn):
            a = QAction(text, self)
            if keys:
                a.setShortcut(QKeySequence(keys))
                a.setShortcutContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
            a.triggered.connect(fn)
            self.addAction(a)
            return a

        self.act_gpu = [act(f"Move to GPU {i}", f"{i + 1}" if i < 9 else None,
                            lambda _=False, i=i: self.move_selection(Assignment(f"gpu:{i}"))) for i in range(8)]
        self.act_cpu = act("Move to CPU (compute)", "C", lambda: self.move_selection(CPU_COMPUTE))
        self.act_stream = act("Move to CPU (stream to GPU)", "S", lambda: self.move_selection(CPU_STREAM))
        self.act_all = act("Select all", QKeySequence.StandardKey.SelectAll, self.grid.select_all)
        self.act_none = act("Clear selection", "Esc", self.grid.clear_selection)
        self.act_rows = act("Select whole layers", "R", self._select_rows_of_selection)

    def _select_rows_of_selection(self) -> None:
        rows = sorted({r for r, _ in self.grid.selected_cells()})
        if rows:
            self.grid.select_rows(rows)

    def _context_menu(self, global_pos) -> None:
        menu = QMenu(self)
        n_gpus = len([t for t in self.session.tiers() if t != "cpu"])
        for a in self.act_gpu[:n_gpus]:
            menu.addAction(a)
        menu.addAction(self.act_cpu)
        menu.addAction(self.act_stream)
        menu.addSeparator()
        menu.addAction(self.act_rows)
        menu.addAction(self.act_all)
        menu.addAction(self.act_none)
        menu.popup(global_pos)
