"""The workbench window: menus, docks, banner, status bar with job progress, undo stack."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QKeySequence, QUndoStack
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QToolBar,
)

from workbench.core.errors import WorkbenchError
from workbench.session import Session, services

from .bridge import connect_gui
from .chat_dock import ChatDock
from .experts_dock import ExpertsDock
from .jobs import Job
from .memory_dock import MemoryDock
from .model_dock import ModelDock
from .performance_dock import PerformanceDock

log = logging.getLogger(__name__)
MAX_RECENT = 10


class MainWindow(QMainWindow):
    def __init__(self, session: Session | None = None, settings: QSettings | None = None):
        super().__init__()
        self.session = session or Session()
        services.GUI_CORES = 1  # the engine leaves a core to this window's thread
        self.settings = settings or QSettings("moe-workbench", "workbench")
        self.undo_stack = QUndoStack(self)
        self.job: Job | None = None
        self.resize(1560, 960)

        self.banner = QLabel("")
        self.banner.setWordWrap(False)
        self.banner.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.banner.setStyleSheet("QLabel{background:#5a3d00;color:#ffe9b0;padding:4px 8px;}")
        bar = QToolBar("banner")
        bar.setMovable(False)
        bar.addWidget(self.banner)
        self.addToolBar(Qt.ToolBarArea.TopToolBarArea, bar)
        self.banner_bar = bar
        bar.hide()

        self.experts = ExpertsDock(self.session, self.undo_stack, self.show_status)
        self.setCentralWidget(self.experts)
        self.model_dock = ModelDock(self.session)
        self.memory_dock = MemoryDock(self.session)
        self.docks: dict[str, QDockWidget] = {}
        self._add_dock("Model", self.model_dock, Qt.DockWidgetArea.LeftDockWidgetArea)
        self._add_dock("Memory", self.memory_dock, Qt.DockWidgetArea.RightDockWidgetArea)
        self.performance_dock = PerformanceDock(self.session)
        self.chat_dock = ChatDock(self.session, self.generate, self.cancel_job)
        self._add_dock("Chat", self.chat_dock, Qt.DockWidgetArea.RightDockWidgetArea)
        self._add_dock("Performance", self.performance_dock, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.performance_dock.setMinimumHeight(160)
        QTimer.singleShot(0, self._initial_dock_sizes)
        self.model_dock.setMinimumWidth(300)
        self.memory_dock.setMinimumWidth(320)
        self.chat_dock.setMinimumWidth(320)

        self.status_label = QLabel("")
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(240)
        self.progress.setRange(0, 1000)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_job)
        sb = self.statusBar()
        sb.addWidget(self.status_label, 1)
        self.engine_label = QLabel("engine: not loaded")
        sb.addPermanentWidget(self.engine_label)
        self.hardware_label = QLabel("")
        sb.addPermanentWidget(self.hardware_label)
        sb.addPermanentWidget(self.progress)
        sb.addPermanentWidget(self.cancel_button)
        self.progress.hide()
        self.cancel_button.hide()

        self.live_timer = QTimer(self)
        self.live_timer.setInterval(250)
        self.live_timer.timeout.connect(self._live_tick)
        self._make_menus()
        ev = self.session.events
        connect_gui(ev.project_changed, self._on_project_changed, self)
        connect_gui(ev.message, lambda text: self.show_status(text), self)
        connect_gui(ev.engine_state, self._on_engine_state, self)
        self._on_project_changed(None, False)

    def _initial_dock_sizes(self) -> None:
        h = self.height()
        self.resizeDocks([self.docks["Memory"], self.docks["Chat"]], [int(h * 0.36), int(h * 0.4)],
                         Qt.Orientation.Vertical)
        self.resizeDocks([self.docks["Model"], self.docks["Memory"]], [340, 430], Qt.Orientation.Horizontal)
        self.resizeDocks([self.docks["Performance"]], [int(h * 0.2)], Qt.Orientation.Vertical)

    def _add_dock(self, title: str, widget, area) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock_{title}")
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        self.docks[title] = dock
        return dock

    # -- status, banner, jobs --------------------------------------------------------------------

    def show_status(self, text: str, error: bool = False) -> None:
        self.status_label.setStyleSheet("color:#ff6060;" if error else "")
        self.status_label.setText(text)
        self.status_label.setToolTip(text)

    def set_banner(self, text: str) -> None:
        self.banner.setText(text)
        self.banner.setToolTip(text)
        self.banner_bar.setVisible(bool(text))

    def run_job(self, name: str, fn, on_done, cancellable: bool = True, collect_first: bool = False) -> Job | None:
        """Run ``fn(progress, cancel)`` in a worker; ``on_done(result)`` on success (GUI thread).
        ``collect_first``: run the garbage collector here first (for jobs that collect on their
        own thread, like engine loads: that collection must not be the one that frees Qt objects)."""
        if self.job is not None and self.job.running:
            self.show_status(f"Busy with {self.job.name}; wait or cancel it first", True)
            return None
        if collect_first:
            gc.collect()
        job = Job(name, fn, self)
        self.job = job
        self.progress.setValue(0)
        self.progress.setFormat(f"{name} %p%")
        self.progress.show()
        self.cancel_button.setVisible(cancellable)
        self.show_status(f"{name}…")
        job.progressed.connect(self._on_progress)

        def finished(result, error):
            self.progress.hide()
            self.cancel_button.hide()
            if self.job is job:
                self.job = None
            if error is not None:
                msg = str(error) if isinstance(error, WorkbenchError) else f"{type(error).__name__}: {error}"
                if not isinstance(error, WorkbenchError):
                    log.error("%s failed", name, exc_info=error)
                self.show_status(f"{name} failed: {msg}", True)
                return
            on_done(result)

        job.finished.connect(finished)
        return job.start()

    def _on_engine_state(self, state: str, message: str) -> None:
        text = {"none": "engine: not loaded", "loading": "engine: loading…", "error": "engine: failed"}.get(
            state, f"engine: {self.session.engine_placement_summary()}" if state == "ready" else f"engine: {state}")
        self.engine_label.setText(text)
        self.engine_label.setToolTip(message)

    def _on_progress(self, fraction: float, message: str) -> None:
        self.progress.setValue(int(1000 * max(0.0, min(1.0, fraction))))
        if message:
            self.show_status(message)

    def cancel_job(self) -> None:
        if self.job is not None:
            self.job.cancel.set()
            self.show_status(f"Cancelling {self.job.name}…")

    # -- files -------------------------------------------------------------------------------------

    def open_path(self, path: str | Path) -> Job | None:
        """Open a model folder, a .gguf file or a project .json (read in a worker)."""
        path = Path(path)
        if not self.maybe_save():
            return None
        is_project = services.is_project_file(path)
        hardware = self.session.hardware

        def work(progress, cancel):
            progress(0.1, f"reading {path.name}")
            result = services.load_project(path) if is_project else services.open_model(path)
            progress(0.6, "sizing units and building the cost model")
            inv = result[0] if is_project else result
            services.prepare(inv, (result[2] or hardware) if is_project else hardware)
            return result

        def done(result):
            self.undo_stack.clear()
            if is_project:
                self.session.apply_project(result, path)
            else:
                self.session.set_model(result)
            self.add_recent(path)
            self.show_status(f"Opened {path}")

        return self.run_job(f"Open {path.name}", work, done, cancellable=False)

    def open_model_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open a model folder (Cancel to pick a .gguf file)")
        if not path:
            path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "", "GGUF (*.gguf)")
        if path:
            self.open_path(path)

    def open_project_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open project", "", "Workbench project (*.json)")
        if path:
            self.open_path(path)

    def save_project(self, path: str | Path | None = None) -> bool:
        path = path or self.session.project_path
        if path is None:
            return self.save_project_as()
        try:
            self.session.save_project(path)
        except WorkbenchError as e:
            self.show_status(f"Save failed: {e}", True)
            return False
        self.undo_stack.setClean()
        self.add_recent(Path(path))
        self.show_status(f"Saved {path}")
        return True

    def save_project_as(self) -> bool:
        path, _ = QFileDialog.getSaveFileName(self, "Save project", "", "Workbench project (*.json)")
        return bool(path) and self.save_project(path)

    def maybe_save(self) -> bool:
        """Ask about unsaved changes; False if the user cancels."""
        if not self.session.dirty or self.session.inventory is None:
            return True
        answer = QMessageBox.question(
            self, "Unsaved changes", "The project has unsaved changes. Save them first?",
            QMessageBox.StandardButton.Save | QMessageBox.StandardButton.Discard | QMessageBox.StandardButton.Cancel,
        )
        if answer == QMessageBox.StandardButton.Save:
            return self.save_project()
        return answer == QMessageBox.StandardButton.Discard

    def recent_files(self) -> list[str]:
        value = self.settings.value("recent", [])
        if isinstance(value, str):
            value = [value]
        return [str(v) for v in (value or [])]

    def add_recent(self, path: Path) -> None:
        p = str(Path(path).resolve())
        recent = [p] + [r for r in self.recent_files() if r != p]
        self.settings.setValue("recent", recent[:MAX_RECENT])
        self._fill_recent_menu()

    def _fill_recent_menu(self) -> None:
        self.recent_menu.clear()
        for p in self.recent_files():
            self.recent_menu.addAction(p, lambda p=p: self.open_path(p))
        self.recent_menu.setEnabled(bool(self.recent_files()))

    def export_to(self, target: str) -> None:
        from .export_dialog import ExportDialog

        try:
            result = services.export(self.session, target)
        except WorkbenchError as e:
            self.show_status(f"Export failed: {e}", True)
            return
        self.export_dialog = ExportDialog(target, result, self)
        self.export_dialog.open()

    def closeEvent(self, event) -> None:
        if self.maybe_save():
            if self.job is not None:
                self.job.cancel.set()
            for timer in (getattr(self, "telemetry_timer", None), self.live_timer):
                if timer is not None:
                    timer.stop()
            self.session.close_engine()
            self.session.stop_telemetry()
            self.session.events.disconnect()
            event.accept()
        else:
            event.ignore()

    def _on_project_changed(self, path, dirty: bool) -> None:
        inv = self.session.inventory
        name = Path(path).name if path else (inv.path.name if inv is not None else "no model")
        self.setWindowTitle(f"{name}[*] — MoE Workbench")
        self.setWindowModified(dirty)

    # -- engine jobs -------------------------------------------------------------------------------

    def apply_placement(self, then=None, force: bool = False) -> Job | None:
        """Load (or migrate) the engine to the current placement in a worker. A placement whose
        estimate exceeds free RAM or VRAM asks first, saying by how much ("load anyway")."""
        if self.session.inventory is None:
            self.show_status("Open a model first", True)
            return None
        reason = self.session.load_guardrail()
        if reason and not force:
            if not self.confirm_load_anyway(reason):
                self.show_status(f"Not loaded: {reason}", True)
                return None
            force = True

        def done(_result):
            self.show_status(f"Engine ready: {self.session.engine_placement_summary()}")
            if then is not None:
                then()

        return self.run_job("Apply placement",
                            lambda progress, cancel: self.session.load_engine(progress, cancel, force), done,
                            collect_first=True)

    def confirm_load_anyway(self, reason: str) -> bool:
        box = QMessageBox(QMessageBox.Icon.Warning, "The placement does not fit",
                          f"Loading this placement would not fit:\n\n{reason}\n\nLoad anyway?", parent=self)
        anyway = box.addButton("Load anyway", QMessageBox.ButtonRole.AcceptRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.exec()
        return box.clickedButton() is anyway

    def profile(self) -> Job | None:
        """Run the calibration prompts through the engine and make their routing the stats."""
        if self.session.inventory is None:
            self.show_status("Open a model first", True)
            return None
        if self.session.engine is None:
            return self.apply_placement(then=self.profile)
        try:
            prompts = services.calibration_prompts()
        except WorkbenchError as e:
            self.show_status(str(e), True)
            return None

        def done(counts):
            self.session.set_counts(counts, "profiled")
            self.show_status(f"Profiled routing on {len(prompts)} calibration prompts")

        return self.run_job("Profile", lambda progress, cancel: self.session.profile(prompts, progress, cancel), done)

    def generate(self) -> Job | None:
        """Answer the conversation in a worker (loads the engine first if needed)."""
        if self.session.inventory is None:
            self.chat_dock.generation_failed("Open a model first")
            return None
        if self.session.engine is None:
            job = self.apply_placement(then=self.generate)
            if job is None:
                self.chat_dock.generation_failed("The engine is not loaded (Run ▸ Apply placement)")
            return job

        def work(_progress, cancel):
            return self.session.generate_reply(cancel)

        def done(message):
            self.session.finish_reply(message)
            st = message.stats
            self.show_status(f"Reply: {st.get('tokens', 0)} tokens at {st.get('decode_tps', 0):.1f} tok/s "
                             f"({st.get('stop_reason', '?')})")

        self.session.start_live_routing()
        job = self.run_job("Generate", work, done)
        if job is not None:
            job.finished.connect(lambda _r, e: e is not None and self.chat_dock.generation_failed(str(e)))
            self.live_timer.start()
            job.finished.connect(lambda *_: (self.live_timer.stop(), self.session.read_live_counts()))
        return job

    def _live_tick(self) -> None:
        if self.experts.live.isChecked():
            self.session.read_live_counts()

    # -- hardware ----------------------------------------------------------------------------------

    def start_hardware(self) -> None:
        """Start telemetry, pick the profile to plan for, say in the banner when there is no GPU."""
        try:
            self.session.detect_hardware()
        except WorkbenchError as e:
            self.set_banner(f"No hardware profile: {e}")
        self._on_hardware(self.session.hardware)
        self.telemetry_timer = QTimer(self)
        self.telemetry_timer.setInterval(250)
        self.telemetry_timer.timeout.connect(self.session.telemetry_tick)
        self.telemetry_timer.start()

    def _on_hardware(self, profile) -> None:
        note = self.session.hardware_note
        sampler = self.session.sampler
        no_gpu = sampler is None or not sampler.n_gpus
        self.set_banner(note if no_gpu or "preset" in note.lower() and "no preset" in note.lower() else "")
        if profile is not None:
            self.hardware_label.setText(f"planning for: {profile.name}")

    def _fill_hardware_menu(self) -> None:
        menu = self.hardware_menu
        menu.clear()
        try:
            presets = services.presets()
        except WorkbenchError as e:
            menu.addAction(f"no presets: {e}").setEnabled(False)
            return
        current = self.session.hardware.name if self.session.hardware is not None else ""
        menu.addSection(f"Planning for: {current or 'nothing'}")
        machines = menu.addMenu("Measured machines")
        for key in sorted(presets.machines):
            machines.addAction(key, lambda k=key: self.use_preset(k))
        for host in sorted(presets.hosts):
            sub = menu.addMenu(f"GPU in a {host} host")
            for gpu in sorted(presets.gpus):
                sub.addAction(presets.gpus[gpu].get("name", gpu), lambda n=f"{gpu}+{host}": self.use_preset(n))
            sub.addSeparator()
            sub.addAction("2x RTX 3090", lambda n=f"2x rtx3090+{host}": self.use_preset(n))
            sub.addAction("no GPU (CPU only)", lambda n=host: self.use_preset(n))

    def use_preset(self, name: str) -> None:
        try:
            profile = services.preset(name)
        except WorkbenchError as e:
            self.show_status(str(e), True)
            return
        self.session.set_hardware(profile, f"preset {name} chosen in the Hardware menu")
        self._on_hardware(profile)
        self.show_status(f"Planning for {profile.name}")

    # -- menus -------------------------------------------------------------------------------------

    def _make_menus(self) -> None:
        mb = self.menuBar()
        f = mb.addMenu("&File")
        f.addAction("Open &model…", QKeySequence.StandardKey.Open, self.open_model_dialog)
        f.addAction("Open &project…", QKeySequence("Ctrl+Shift+O"), self.open_project_dialog)
        self.recent_menu = f.addMenu("&Recent")
        self._fill_recent_menu()
        f.addSeparator()
        f.addAction("&Save project", QKeySequence.StandardKey.Save, self.save_project)
        f.addAction("Save project &as…", QKeySequence.StandardKey.SaveAs, self.save_project_as)
        exp = f.addMenu("&Export placement")
        for target, title in (("llama.cpp", "llama.cpp (-ot / --n-cpu-moe)"), ("ktransformers", "KTransformers"),
                              ("accelerate", "accelerate device_map")):
            exp.addAction(title, lambda t=target: self.export_to(t))
        f.addSeparator()
        f.addAction("&Quit", QKeySequence.StandardKey.Quit, self.close)

        e = mb.addMenu("&Edit")
        undo = self.undo_stack.createUndoAction(self, "&Undo")
        undo.setShortcut(QKeySequence.StandardKey.Undo)
        redo = self.undo_stack.createRedoAction(self, "&Redo")
        redo.setShortcut(QKeySequence.StandardKey.Redo)
        e.addAction(undo)
        e.addAction(redo)
        self.undo_action, self.redo_action = undo, redo

        self.hardware_menu = mb.addMenu("&Hardware")
        self.hardware_menu.aboutToShow.connect(self._fill_hardware_menu)
        self.run_menu = mb.addMenu("&Run")
        self.run_menu.addAction("&Apply placement (load the engine)", QKeySequence("Ctrl+L"), self.apply_placement)
        self.run_menu.addAction("&Profile routing on the calibration prompts", QKeySequence("Ctrl+P"), self.profile)
        self.run_menu.addAction("&Stop", QKeySequence("Ctrl+."), self.cancel_job)
        self.run_menu.addSeparator()
        self.run_menu.addAction("&Unload the engine", self.session.close_engine)
        self.view_menu = mb.addMenu("&View")
        for dock in self.docks.values():
            self.view_menu.addAction(dock.toggleViewAction())
