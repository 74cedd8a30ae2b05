"""Model dock: the inventory as a tree (layers -> attention, router, shared, experts) with sizes and
storage types, and the memory estimate for a chosen context length."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QFormLayout,
    QHeaderView,
    QLabel,
    QSpinBox,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from workbench.core.fmt import bytes2human, params2human
from workbench.core.memory import experts_as_stored
from workbench.core.units import UnitKey
from workbench.session import Session, code_assignment, services

from .bridge import connect_gui

KIND_TITLES = {
    "embed": "token embeddings", "attn": "attention", "router": "router", "shared": "shared expert",
    "expert": "routed experts", "dense_mlp": "dense MLP", "norm": "final norm", "lm_head": "output head (lm_head)",
}
KV_DTYPES = ("f16", "bf16", "f32", "q8_0", "q4_0")
_EXPERTS_ROLE = Qt.ItemDataRole.UserRole + 1


class ModelDock(QWidget):
    """Views ``session.inventory`` and ``session.prediction()``; edits ctx and KV dtype."""

    def __init__(self, session: Session, parent=None):
        super().__init__(parent)
        self.session = session
        self.summary = QLabel("No model open. File ▸ Open model…")
        self.summary.setWordWrap(True)
        self.summary.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(["unit", "bytes", "params", "types", "tier"])
        self.tree.setUniformRowHeights(True)
        self.tree.setAlternatingRowColors(True)
        self.tree.itemExpanded.connect(self._fill_experts)
        self.ctx = QSpinBox()
        self.ctx.setRange(1, 1 << 21)
        self.ctx.setSingleStep(1024)
        self.ctx.setValue(session.ctx)
        self.ctx.setSuffix(" tokens")
        self.ctx.setKeyboardTracking(False)
        self.kv = QComboBox()
        self.kv.addItems(KV_DTYPES)
        self.kv.setCurrentText(session.kv_dtype)
        self.estimate = QLabel("")
        self.estimate.setTextFormat(Qt.TextFormat.RichText)
        form = QFormLayout()
        form.addRow("context", self.ctx)
        form.addRow("KV cache type", self.kv)
        lay = QVBoxLayout(self)
        lay.addWidget(self.summary)
        lay.addWidget(self.tree, 1)
        lay.addLayout(form)
        lay.addWidget(self.estimate)
        self.ctx.valueChanged.connect(lambda v: self.session.set_context(v, self.kv.currentText()))
        self.kv.currentTextChanged.connect(lambda t: self.session.set_context(self.ctx.value(), t))
        ev = session.events
        connect_gui(ev.model_opened, self._on_model_opened, self)
        connect_gui(ev.prediction_changed, self._on_prediction, self)
        connect_gui(ev.placement_changed, self._on_placement, self)
        connect_gui(ev.settings_changed, self._on_settings, self)

    # -- events --------------------------------------------------------------------------------

    def _on_settings(self) -> None:
        for w, v in ((self.ctx, self.session.ctx),):
            if w.value() != v:
                w.blockSignals(True)
                w.setValue(v)
                w.blockSignals(False)

    def _on_model_opened(self, inv) -> None:
        s = inv.spec
        self.ctx.blockSignals(True)
        self.ctx.setMaximum(max(1, int(s.max_context or 1 << 21)))
        self.ctx.setValue(self.session.ctx)
        self.ctx.blockSignals(False)
        types = ", ".join(f"{t} {bytes2human(b)}" for t, b in list(inv.dtype_mix().items())[:4])
        moe = f"{s.n_experts} experts, {s.n_experts_active} active" if s.is_moe else "dense"
        note = ""
        if s.is_moe and not experts_as_stored(inv):
            note = "<br><i>routed experts dequantized to bf16 at load (the engine cannot read their type in place)</i>"
        self.summary.setText(
            f"<b>{inv.path.name}</b> · {inv.family} · {inv.format}<br>"
            f"{params2human(inv.params_total)} params · {bytes2human(inv.total_bytes)} · {s.n_layers} layers · {moe}"
            f"<br>{types}{note}"
        )
        self._build_tree(inv)

    def _build_tree(self, inv) -> None:
        self.tree.clear()
        self._sizes = services.unit_sizes(inv)
        by_layer: dict[int | None, dict[str, list[UnitKey]]] = defaultdict(lambda: defaultdict(list))
        for key in sorted(inv.units):
            by_layer[key.layer][key.kind].append(key)
        model_wide = by_layer.pop(None, {})
        for kind in ("embed",):
            for key in model_wide.get(kind, []):
                self.tree.addTopLevelItem(self._unit_item(inv, [key], KIND_TITLES[kind]))
        for layer in sorted(by_layer):
            kinds = by_layer[layer]
            keys = [k for ks in kinds.values() for k in ks]
            item = self._unit_item(inv, keys, f"layer {layer}")
            for kind, ks in kinds.items():
                child = self._unit_item(inv, ks, KIND_TITLES[kind] + (f" ({len(ks)})" if kind == "expert" else ""))
                if kind == "expert":
                    child.setData(0, _EXPERTS_ROLE, ks)
                    child.setChildIndicatorPolicy(QTreeWidgetItem.ChildIndicatorPolicy.ShowIndicator)
                item.addChild(child)
            self.tree.addTopLevelItem(item)
        for kind in ("norm", "lm_head"):
            for key in model_wide.get(kind, []):
                self.tree.addTopLevelItem(self._unit_item(inv, [key], KIND_TITLES[kind]))
        for i in range(1, 5):
            self.tree.resizeColumnToContents(i)
        self.tree.header().setStretchLastSection(False)
        self.tree.header().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self._on_placement(self.session.placement)

    def _unit_item(self, inv, keys: list[UnitKey], title: str) -> QTreeWidgetItem:
        sizes = self._sizes
        nbytes = sum(sizes[k][0] for k in keys)
        params = sum(sizes[k][1] for k in keys)
        types = sorted({d for k in keys for d in sizes[k][2]})
        item = QTreeWidgetItem([title, bytes2human(nbytes), params2human(params), ", ".join(types), ""])
        item.setData(0, Qt.ItemDataRole.UserRole, keys)
        item.setTextAlignment(1, Qt.AlignmentFlag.AlignRight)
        item.setTextAlignment(2, Qt.AlignmentFlag.AlignRight)
        return item

    def _fill_experts(self, item: QTreeWidgetItem) -> None:
        keys = item.data(0, _EXPERTS_ROLE)
        if not keys or item.childCount():
            return
        inv = self.session.inventory
        for key in keys:
            child = self._unit_item(inv, [key], f"expert {key.expert}")
            child.setText(4, str(self.session.placement.get(key)))
            item.addChild(child)

    def _on_placement(self, placement) -> None:
        """Fill the tier column: one tier, or "mixed" with counts. Routed experts are counted
        from the session's tier grid (numpy), so a 94 x 256 model refreshes quickly."""
        grid = self.session.tier_grid()
        row_of = {layer: i for i, layer in enumerate(self.session.moe_layers)}
        root = self.tree.invisibleRootItem()
        stack = [root.child(i) for i in range(root.childCount())]
        while stack:
            item = stack.pop()
            keys = item.data(0, Qt.ItemDataRole.UserRole) or []
            tiers: dict[str, int] = defaultdict(int)
            experts_layers = set()
            for k in keys:
                if k.kind == "expert" and len(keys) > 1 and k.layer in row_of:
                    experts_layers.add(k.layer)
                else:
                    tiers[str(placement.get(k))] += 1
            for layer in experts_layers:
                codes, counts = np.unique(grid[row_of[layer]], return_counts=True)
                for c, n in zip(codes.tolist(), counts.tolist()):
                    tiers[str(code_assignment(c))] += n
            if len(tiers) == 1:
                _set_tier(item, next(iter(tiers)))
            elif tiers:
                _set_tier(item, " · ".join(f"{t} {n}" for t, n in sorted(tiers.items())), mixed=True)
            if item.isExpanded() or item.data(0, _EXPERTS_ROLE) is None:
                stack.extend(item.child(i) for i in range(item.childCount()))
            else:
                for i in range(item.childCount()):
                    child = item.child(i)
                    k = child.data(0, Qt.ItemDataRole.UserRole)[0]
                    _set_tier(child, str(placement.get(k)))
        self.tree.resizeColumnToContents(4)

    def _on_prediction(self, pred) -> None:
        mem = pred.memory
        if mem is None:
            self.estimate.setText("<i>no memory estimate (the memory model is not available)</i>")
            return
        rows = []
        for tier, t in mem.tiers.items():
            budget = pred.budgets.get(tier)
            colour = "#e05050" if tier in pred.over else "inherit"
            budget_txt = f" of {bytes2human(budget)}" if budget is not None else ""
            rows.append(
                f"<tr><td><b>{tier}</b></td><td style='color:{colour}' align=right>{bytes2human(t.total)}{budget_txt}</td>"
                f"<td>weights {bytes2human(t.weights_total)} · KV {bytes2human(t.kv_cache)}"
                f" · stream {bytes2human(t.stream_cache)} · runtime {bytes2human(t.overhead)}</td></tr>"
            )
        self.estimate.setText(f"<table cellspacing=4>{''.join(rows)}</table>")


_SHORT_TIERS = {"cpu:compute": "CPU", "cpu:stream": "stream"}


def _set_tier(item: QTreeWidgetItem, text: str, mixed: bool = False) -> None:
    """Tier column: short names (``gpu:0`` -> ``GPU0``, ``cpu:compute`` -> ``CPU``, several tiers ->
    ``mixed``) so the column leaves room for the unit names; the full text is in the tooltip."""
    short = "mixed" if mixed else _SHORT_TIERS.get(text, text.replace("gpu:", "GPU"))
    item.setText(4, short)
    item.setToolTip(4, text)
