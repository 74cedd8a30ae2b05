"""Export dialog: the placement translated for another engine, to the clipboard or a file."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFileDialog, QPlainTextEdit, QVBoxLayout


class ExportDialog(QDialog):
    def __init__(self, target: str, export, parent=None):
        super().__init__(parent)
        self.export = export
        text = str(export)
        self.setWindowTitle(f"Export for {target}")
        self.resize(820, 480)
        self.text = QPlainTextEdit(text)
        self.text.setReadOnly(True)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        copy = buttons.addButton("Copy to clipboard", QDialogButtonBox.ButtonRole.ActionRole)
        save = buttons.addButton("Save to file…", QDialogButtonBox.ButtonRole.ActionRole)
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(text))
        save.clicked.connect(self._save)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addWidget(self.text)
        lay.addWidget(buttons)

    def _save(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save export")
        if path:
            self.save_to(Path(path))

    def save_to(self, path: Path) -> list[Path]:
        """Write the export to ``path`` and its extra files (e.g. KTransformers' frequency file)
        beside it; returns every path written."""
        path.write_text(str(self.export) + "\n", encoding="utf-8")
        written = [path]
        for name, content in getattr(self.export, "files", {}).items():
            extra = path.parent / name
            extra.write_text(content, encoding="utf-8")
            written.append(extra)
        return written
