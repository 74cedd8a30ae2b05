"""The layers x experts grid: colour = routing frequency, cell frame = tier, with selection and drag.

Drawn as two pyqtgraph ImageItems (one RGBA picture of all cells, one selection overlay), not one
item per cell, so a 94 x 256 grid redraws in milliseconds. A cell is one unit of view coordinates:
column = expert, row = index into the model's MoE layers (row 0 at the top).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QDrag, QPen
from PySide6.QtWidgets import QGraphicsRectItem, QToolTip

from workbench.session import TIER_CPU_COMPUTE, TIER_CPU_STREAM, TIER_GPU0

CELL_PX = 6
"""Fewest image pixels per cell side: a 1-pixel frame in the tier's colour around the frequency core."""

FREQ_MAX = 3.0
"""Relative frequency (1 = an average expert of its layer) at the top of the colour scale."""

GPU_COLOURS = ("#37d67a", "#4aa3ff", "#c77dff", "#ffd23f", "#ff6b9d", "#00d1c1", "#a0e426", "#ff8f5a")
CPU_COLOUR = "#5a5a66"
STREAM_COLOUR = "#ff9f1c"
NO_STATS = (44, 44, 52, 255)


def tier_colour(code: int) -> str:
    if code == TIER_CPU_COMPUTE:
        return CPU_COLOUR
    if code == TIER_CPU_STREAM:
        return STREAM_COLOUR
    return GPU_COLOURS[(code - TIER_GPU0) % len(GPU_COLOURS)]


def _rgba(hex_colour: str) -> tuple[int, int, int, int]:
    c = QColor(hex_colour)
    return c.red(), c.green(), c.blue(), 255


FREQ_CMAP = pg.colormap.get("inferno")


def cell_px(rows: int, cols: int) -> int:
    """Image pixels per cell: 6 for big grids, more for small ones so the frame stays thin."""
    return int(np.clip(np.ceil(480 / max(rows, cols, 1)), CELL_PX, 32))


def render_cells(freq: np.ndarray, tiers: np.ndarray) -> np.ndarray:
    """RGBA picture ``[R * s, E * s, 4]`` uint8 of the grid (row-major, row 0 on top), ``s = cell_px``.

    ``freq``: relative frequency ``[R, E]`` float (NaN = not counted); ``tiers``: tier codes ``[R, E]``.
    """
    r, e = tiers.shape
    lut = np.array([_rgba(tier_colour(c)) for c in range(TIER_GPU0 + len(GPU_COLOURS))], dtype=np.uint8)
    frame = lut[np.clip(tiers.astype(np.int64), 0, len(lut) - 1)]  # [R, E, 4]
    core = np.empty((r, e, 4), dtype=np.uint8)
    known = np.isfinite(freq)
    core[~known] = NO_STATS
    if known.any():
        scaled = np.sqrt(np.clip(freq[known] / FREQ_MAX, 0.0, 1.0))
        core[known] = FREQ_CMAP.map(scaled, mode="byte")
    s = cell_px(r, e)
    img = np.repeat(np.repeat(frame, s, axis=0), s, axis=1)
    f = max(1, s // 12)  # frame width
    img.reshape(r, s, e, s, 4)[:, f : s - f, :, f : s - f, :] = core[:, None, :, None, :]
    return img


class _GridViewBox(pg.ViewBox):
    """Left button selects (click, rubber band, double-click a row) or drags the selection;
    right button opens the context menu; the wheel zooms; the middle button pans."""

    def __init__(self, grid: ExpertGrid):
        super().__init__(invertY=True, enableMenu=False)
        self.grid = grid
        self.setMouseEnabled(x=True, y=True)
        self._band: QRectF | None = None
        self._dragging_units = False

    def mouseClickEvent(self, ev):
        cell = self.grid.cell_at(self.mapSceneToView(ev.scenePos()))
        if ev.button() == Qt.MouseButton.RightButton:
            ev.accept()
            if cell is not None and not self.grid.selection[cell]:
                self.grid.select_cells([cell])
            self.grid.context_menu_requested.emit(ev.screenPos().toPoint())
            return
        if ev.button() != Qt.MouseButton.LeftButton:
            return super().mouseClickEvent(ev)
        ev.accept()
        mods = ev.modifiers()
        if cell is None:
            if not mods:
                self.grid.clear_selection()
            return
        if ev.double():
            self.grid.select_rows([cell[0]], add=bool(mods & Qt.KeyboardModifier.ControlModifier))
        elif mods & Qt.KeyboardModifier.ShiftModifier and self.grid.anchor is not None:
            self.grid.select_rect(self.grid.anchor, cell, add=bool(mods & Qt.KeyboardModifier.ControlModifier))
        elif mods & Qt.KeyboardModifier.ControlModifier:
            self.grid.toggle_cell(cell)
        else:
            self.grid.select_cells([cell])

    def mouseDragEvent(self, ev, axis=None):
        if ev.button() != Qt.MouseButton.LeftButton:
            return super().mouseDragEvent(ev, axis)
        ev.accept()
        if ev.isStart():
            start = self.grid.cell_at(self.mapSceneToView(ev.buttonDownScenePos()))
            self._dragging_units = start is not None and bool(self.grid.selection[start])
            if self._dragging_units:
                self.grid.start_drag()
                return
            self._band_start = self.mapSceneToView(ev.buttonDownScenePos())
        if self._dragging_units:
            return
        now = self.mapSceneToView(ev.scenePos())
        self.grid.show_band(QRectF(self._band_start, now).normalized())
        if ev.isFinish():
            self.grid.show_band(None)
            add = bool(ev.modifiers() & Qt.KeyboardModifier.ControlModifier)
            a = self.grid.clamp_cell(self._band_start)
            b = self.grid.clamp_cell(now)
            if a is not None and b is not None:
                self.grid.select_rect(a, b, add=add)


class _RowAxis(pg.AxisItem):
    """The layer axis: a click selects that layer's whole row (ctrl adds)."""

    def __init__(self, grid: ExpertGrid):
        super().__init__("left")
        self.view = grid

    def mouseClickEvent(self, ev):
        if ev.button() != Qt.MouseButton.LeftButton:
            return
        ev.accept()
        y = self.linkedView().mapSceneToView(ev.scenePos()).y()
        row = int(np.floor(y))
        if 0 <= row < self.view.n_rows:
            self.view.select_rows([row], add=bool(ev.modifiers() & Qt.KeyboardModifier.ControlModifier))


class ExpertGrid(pg.PlotWidget):
    """The heatmap view. It draws what it is given (:meth:`set_cells`) and owns only the selection,
    which is view state, not model state. ``drag_mime`` builds the payload of a drag (set by the
    panel); ``tooltip_for(row, expert)`` the text of a cell's tooltip."""

    selection_changed = Signal()
    context_menu_requested = Signal(object)  # QPoint, global

    def __init__(self, parent=None):
        self._vb = _GridViewBox(self)
        self._axis = _RowAxis(self)
        super().__init__(parent, viewBox=self._vb, axisItems={"left": self._axis})
        self.setBackground("#1e1e24")
        self.plotItem.setLabel("left", "layer")
        self.plotItem.setLabel("bottom", "expert")
        self.plotItem.hideButtons()
        self.image = pg.ImageItem(axisOrder="row-major")
        self.overlay = pg.ImageItem(axisOrder="row-major")
        self.addItem(self.image)
        self.addItem(self.overlay)
        self._band_item = QGraphicsRectItem()
        self._band_item.setPen(QPen(QColor("#ffffff"), 0, Qt.PenStyle.DashLine))
        self._band_item.setBrush(QColor(255, 255, 255, 40))
        self._band_item.hide()
        self.addItem(self._band_item)
        self.layers: list[int] = []
        self.selection = np.zeros((0, 0), dtype=bool)
        self.anchor: tuple[int, int] | None = None
        self.drag_mime = None
        self.tooltip_for = None
        self.scene().sigMouseMoved.connect(self._on_mouse_moved)

    @property
    def n_rows(self) -> int:
        return self.selection.shape[0]

    @property
    def n_cols(self) -> int:
        return self.selection.shape[1]

    def set_cells(self, freq: np.ndarray, tiers: np.ndarray, layers: list[int]) -> None:
        """Draw ``tiers`` (codes ``[R, E]``) and ``freq`` (relative frequency ``[R, E]``) for rows ``layers``."""
        shape_changed = tiers.shape != self.selection.shape
        if shape_changed:
            self.selection = np.zeros(tiers.shape, dtype=bool)
            self.anchor = None
        self.layers = list(layers)
        r, e = tiers.shape
        if r and e:
            self.image.setImage(render_cells(freq, tiers), autoLevels=False)
            self.image.setRect(QRectF(0, 0, e, r))
        else:
            self.image.clear()
        self._draw_selection()
        if shape_changed:
            self._set_ticks()
            self._vb.setLimits(xMin=-0.5, xMax=e + 0.5, yMin=-0.5, yMax=r + 0.5)
            self._vb.setRange(QRectF(0, 0, max(e, 1), max(r, 1)), padding=0.01)
            self.selection_changed.emit()

    def _set_ticks(self) -> None:
        r = len(self.layers)
        step = max(1, int(np.ceil(r / 24)))
        self._axis.setTicks([[(i + 0.5, str(layer)) for i, layer in enumerate(self.layers) if i % step == 0]])
        e = self.n_cols
        estep = max(1, int(np.ceil(e / 32)))
        self.plotItem.getAxis("bottom").setTicks([[(j + 0.5, str(j)) for j in range(0, e, estep)]])

    # -- geometry ------------------------------------------------------------------------------

    def cell_at(self, p: QPointF) -> tuple[int, int] | None:
        row, col = int(np.floor(p.y())), int(np.floor(p.x()))
        if 0 <= row < self.n_rows and 0 <= col < self.n_cols:
            return row, col
        return None

    def clamp_cell(self, p: QPointF) -> tuple[int, int] | None:
        if self.n_rows == 0 or self.n_cols == 0:
            return None
        return (int(np.clip(np.floor(p.y()), 0, self.n_rows - 1)), int(np.clip(np.floor(p.x()), 0, self.n_cols - 1)))

    def cell_center_scene(self, row: int, col: int) -> QPointF:
        return self._vb.mapViewToScene(QPointF(col + 0.5, row + 0.5))

    # -- selection -----------------------------------------------------------------------------

    def selected_cells(self) -> list[tuple[int, int]]:
        rows, cols = np.nonzero(self.selection)
        return list(zip(rows.tolist(), cols.tolist()))

    def _changed(self) -> None:
        self._draw_selection()
        self.selection_changed.emit()

    def clear_selection(self) -> None:
        self.selection[:] = False
        self._changed()

    def select_cells(self, cells, add: bool = False) -> None:
        if not add:
            self.selection[:] = False
        for r, c in cells:
            self.selection[r, c] = True
        if cells:
            self.anchor = tuple(cells[-1])
        self._changed()

    def toggle_cell(self, cell) -> None:
        self.selection[cell] = not self.selection[cell]
        self.anchor = tuple(cell)
        self._changed()

    def select_rect(self, a, b, add: bool = False) -> None:
        if not add:
            self.selection[:] = False
        r0, r1 = sorted((a[0], b[0]))
        c0, c1 = sorted((a[1], b[1]))
        self.selection[r0 : r1 + 1, c0 : c1 + 1] = True
        self._changed()

    def select_rows(self, rows, add: bool = False) -> None:
        if not add:
            self.selection[:] = False
        self.selection[list(rows), :] = True
        self._changed()

    def select_all(self) -> None:
        self.selection[:] = True
        self._changed()

    def _draw_selection(self) -> None:
        if not self.selection.size:
            self.overlay.clear()
            return
        ov = np.zeros(self.selection.shape + (4,), dtype=np.uint8)
        ov[self.selection] = (255, 255, 255, 150)
        self.overlay.setImage(ov, autoLevels=False)
        self.overlay.setRect(QRectF(0, 0, self.n_cols, self.n_rows))

    def show_band(self, rect: QRectF | None) -> None:
        if rect is None:
            self._band_item.hide()
        else:
            self._band_item.setRect(rect)
            self._band_item.show()

    # -- drag and tooltips ---------------------------------------------------------------------

    def start_drag(self) -> None:
        """Start a QDrag carrying the selected units (built by ``drag_mime``)."""
        if self.drag_mime is None or not self.selection.any():
            return
        drag = QDrag(self)
        drag.setMimeData(self.drag_mime())
        drag.exec(Qt.DropAction.MoveAction)

    def _on_mouse_moved(self, scene_pos) -> None:
        cell = self.cell_at(self._vb.mapSceneToView(scene_pos))
        if cell is None or self.tooltip_for is None:
            QToolTip.hideText()
            return
        text = self.tooltip_for(*cell)
        QToolTip.showText(self.mapToGlobal(self.mapFromScene(scene_pos)), text, self)
