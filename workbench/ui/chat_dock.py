"""Chat dock: streaming replies with live tokens/s, Stop, Regenerate, edit-and-resend, system
prompt, sampling settings, per-reply stats, context used, folded ``<think>`` blocks and the chat
template (the model's, or an override). The conversation lives in the Session (saved with the
project); this view renders it and the reply being streamed."""

from __future__ import annotations

import html
import re

from PySide6.QtCore import QTimer, QUrl
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTabWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from workbench.session import Session

from .bridge import connect_gui

THINK_RE = re.compile(r"<think>(.*?)(</think>|$)", re.DOTALL)


def render_text(text: str, unfolded: set[str], key: str) -> str:
    """HTML of one message; each ``<think>…</think>`` block folds to a link that unfolds it."""
    out, last = [], 0
    for i, m in enumerate(THINK_RE.finditer(text)):
        out.append(html.escape(text[last : m.start()]))
        block = f"{key}.{i}"
        closed = bool(m.group(2))
        label = "reasoning" if closed else "reasoning…"
        if block in unfolded:
            out.append(f"<a href='fold:{block}'>▼ {label}</a><div style='color:#8a8a99'>"
                       f"{html.escape(m.group(1))}</div>")
        else:
            out.append(f"<a href='fold:{block}'>▶ {label} ({len(m.group(1).split())} words)</a>")
        last = m.end()
    out.append(html.escape(text[last:]))
    return "".join(out).strip().replace("\n", "<br>")


def stats_line(stats: dict) -> str:
    if not stats:
        return ""
    return (f"TTFT {stats.get('ttft_s', 0) * 1000:.0f} ms · prompt {stats.get('prompt_tokens', 0)} tok "
            f"at {stats.get('prefill_tps', 0):.0f} tok/s · {stats.get('tokens', 0)} tok at "
            f"{stats.get('decode_tps', 0):.1f} tok/s · stop: {stats.get('stop_reason', '?')} · context "
            f"{stats.get('context_used', 0)} of {stats.get('context_max', 0)}")


class ChatDock(QWidget):
    """``send(after_edit)`` and ``stop()`` are provided by the window (they run the job)."""

    SAMPLING = (("temperature", 0.0, 5.0, 0.05), ("top_p", 0.01, 1.0, 0.01), ("min_p", 0.0, 1.0, 0.01),
                ("repeat_penalty", 0.5, 2.0, 0.01))

    def __init__(self, session: Session, start_generation, stop_generation, parent=None):
        super().__init__(parent)
        self.session = session
        self.start_generation = start_generation
        self.stop_generation = stop_generation
        self.unfolded: set[str] = set()
        self.streaming = ""
        self.stream_tps = 0.0
        self.editing: int | None = None
        self._dirty_render = False

        self.transcript = QTextBrowser()
        self.transcript.setOpenLinks(False)
        self.transcript.anchorClicked.connect(self._on_anchor)
        self.live = QLabel("")
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message the model… (Ctrl+Enter sends)")
        self.input.setMaximumHeight(80)
        self.send_button = QPushButton("Send")
        self.stop_button = QPushButton("Stop")
        self.regen_button = QPushButton("Regenerate")
        self.new_button = QPushButton("New chat")
        self.send_button.clicked.connect(self.send)
        QShortcut(QKeySequence("Ctrl+Return"), self.input, self.send)
        self.stop_button.clicked.connect(self.stop_generation)
        self.regen_button.clicked.connect(self.regenerate)
        self.new_button.clicked.connect(session.clear_chat)
        self.stop_button.setEnabled(False)
        buttons = QHBoxLayout()
        for b in (self.send_button, self.stop_button, self.regen_button, self.new_button):
            buttons.addWidget(b)

        chat_tab = QWidget()
        lay = QVBoxLayout(chat_tab)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addWidget(self.transcript, 1)
        lay.addWidget(self.live)
        lay.addWidget(self.input)
        lay.addLayout(buttons)

        self.system = QPlainTextEdit(session.chat.system_prompt)
        self.system.setMaximumHeight(70)
        self.system.textChanged.connect(lambda: session.set_chat_settings(system_prompt=self.system.toPlainText()))
        settings_tab = QWidget()
        form = QFormLayout(settings_tab)
        form.addRow("system prompt", self.system)
        self.spins: dict[str, QDoubleSpinBox | QSpinBox] = {}
        for name, lo, hi, step in self.SAMPLING:
            w = QDoubleSpinBox()
            w.setRange(lo, hi)
            w.setSingleStep(step)
            w.setDecimals(2)
            self.spins[name] = w
            form.addRow(name.replace("_", " "), w)
        for name, lo, hi in (("top_k", 0, 100000), ("max_new", 1, 1 << 20)):
            w = QSpinBox()
            w.setRange(lo, hi)
            self.spins[name] = w
            form.addRow(name.replace("_", " "), w)
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("random")
        form.addRow("seed", self.seed)
        for name, w in self.spins.items():
            w.valueChanged.connect(lambda v, n=name: session.set_chat_settings(sampling={n: v}))
        self.seed.editingFinished.connect(self._on_seed)
        self.ignore_eos = QCheckBox("keep going past end-of-text")
        self.ignore_eos.toggled.connect(lambda on: session.set_chat_settings(sampling={"ignore_eos": on}))
        form.addRow("ignore EOS", self.ignore_eos)
        self.template = QPlainTextEdit()
        self.template.setPlaceholderText("empty: the model's own chat template")
        self.template.textChanged.connect(
            lambda: session.set_chat_settings(template_override=self.template.toPlainText()))
        show_model = QPushButton("Show the model's template")
        show_model.clicked.connect(self._show_model_template)
        form.addRow("chat template", self.template)
        form.addRow("", show_model)

        tabs = QTabWidget()
        tabs.addTab(chat_tab, "Chat")
        tabs.addTab(settings_tab, "Settings")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(tabs)
        self.tabs = tabs

        self._render_timer = QTimer(self)
        self._render_timer.setInterval(80)
        self._render_timer.timeout.connect(self._render_if_dirty)
        self._render_timer.start()
        ev = session.events
        connect_gui(ev.chat_changed, self._on_chat_changed, self)
        connect_gui(ev.generation_started, self._on_started, self)
        connect_gui(ev.generation_token, self._on_token, self)
        connect_gui(ev.generation_finished, self._on_finished, self)
        self._on_chat_changed()

    # -- session events ----------------------------------------------------------------------------

    def _on_chat_changed(self) -> None:
        chat = self.session.chat
        for w, v in ((self.system, chat.system_prompt), (self.template, chat.template_override)):
            if w.toPlainText() != v:
                w.blockSignals(True)
                w.setPlainText(v)
                w.blockSignals(False)
        for name, w in self.spins.items():
            v = chat.sampling.get(name)
            if v is not None and w.value() != v:
                w.blockSignals(True)
                w.setValue(v)
                w.blockSignals(False)
        self.seed.setText("" if chat.sampling.get("seed") is None else str(chat.sampling["seed"]))
        self.ignore_eos.blockSignals(True)
        self.ignore_eos.setChecked(bool(chat.sampling.get("ignore_eos", False)))
        self.ignore_eos.blockSignals(False)
        self._dirty_render = True
        self._render_if_dirty()

    def _on_started(self) -> None:
        self.streaming = ""
        self.stream_tps = 0.0
        self._set_busy(True)

    def _on_token(self, delta: str, tps: float) -> None:
        self.streaming += delta
        self.stream_tps = tps
        self._dirty_render = True

    def _on_finished(self, message) -> None:
        self.streaming = ""
        self._set_busy(False)
        self._dirty_render = True
        self.live.setText(stats_line(message.stats))

    def generation_failed(self, text: str) -> None:
        self.streaming = ""
        self._set_busy(False)
        self.live.setText(text)
        self._dirty_render = True

    busy = False

    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.stop_button.setEnabled(busy)
        self.send_button.setEnabled(not busy)
        self.regen_button.setEnabled(not busy)

    # -- rendering -----------------------------------------------------------------------------------

    def _render_if_dirty(self) -> None:
        if not self._dirty_render:
            return
        self._dirty_render = False
        parts = []
        for i, m in enumerate(self.session.chat.messages):
            who = {"user": "You", "assistant": "Model"}.get(m.role, m.role)
            colour = "#4aa3ff" if m.role == "user" else "#37d67a"
            edit = f" <a href='edit:{i}'>edit</a>" if m.role == "user" else ""
            body = render_text(m.content, self.unfolded, str(i))
            stats = f"<div style='color:#8a8a99;font-size:small'>{stats_line(m.stats)}</div>" if m.stats else ""
            parts.append(f"<p><b style='color:{colour}'>{who}</b>{edit}<br>{body}</p>{stats}")
        if self.busy:
            body = render_text(self.streaming, self.unfolded, "live")
            parts.append(f"<p><b style='color:#37d67a'>Model</b> <i>(answering)</i><br>{body}▍</p>")
            used = self.session.chat.context_used
            self.live.setText(f"answering · {self.stream_tps:.1f} tok/s · {len(self.streaming)} chars"
                              + (f" · context before this reply {used}" if used else ""))
        self.transcript.setHtml("".join(parts))
        sb = self.transcript.verticalScrollBar()
        sb.setValue(sb.maximum())

    def _on_anchor(self, url: QUrl) -> None:
        kind, _, arg = url.toString().partition(":")
        if kind == "fold":
            self.unfolded ^= {arg}
            self._dirty_render = True
        elif kind == "edit":
            i = int(arg)
            self.editing = i
            self.input.setPlainText(self.session.chat.messages[i].content)
            self.send_button.setText(f"Resend (edits message {i + 1})")
            self.input.setFocus()

    # -- actions -------------------------------------------------------------------------------------

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.busy:
            return
        if self.editing is not None:
            self.session.edit_message(self.editing, text)
            self.editing = None
            self.send_button.setText("Send")
        else:
            self.session.add_message("user", text)
        self.input.clear()
        self.start_generation()

    def regenerate(self) -> None:
        if self.busy or not self.session.chat.messages:
            return
        self.session.drop_last_reply()
        if self.session.chat.messages and self.session.chat.messages[-1].role == "user":
            self.start_generation()

    def _on_seed(self) -> None:
        text = self.seed.text().strip()
        self.session.set_chat_settings(sampling={"seed": int(text) if text.lstrip("-").isdigit() else None})

    def _show_model_template(self) -> None:
        try:
            runtime = self.session.chat_runtime()
        except Exception as e:  # no engine yet: say so in the transcript area
            self.live.setText(str(e))
            return
        t = runtime.model_template
        self.template.setPlainText(t.source if t is not None else "")
