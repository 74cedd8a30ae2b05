"""Fixtures for the window tests: a model that talks (the bundled demo model when it is there,
else a tiny random qwen3_moe with the demo's tokenizer and chat template), and a clean window."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

DEMO = Path(__file__).resolve().parents[2] / "resources" / "demo"


@pytest.fixture(autouse=True)
def _no_interpreted_kernels(monkeypatch):
    """The window runs the engine as a user's machine without a GPU does: PyTorch paths, not the
    Triton kernels in Triton's (slow, GIL-holding) interpreter that the engine tests use."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A model folder with weights, tokenizer.json and a ChatML chat template."""
    if (DEMO / "model.safetensors").is_file() and (DEMO / "config.json").is_file():
        return DEMO
    src = tiny_model_dir("qwen3_moe", vocab_size=4096, num_hidden_layers=3, mlp_only_layers=[],
                         max_position_embeddings=4096)
    out = tmp_path_factory.mktemp("chat_model") / "tiny-chat"
    shutil.copytree(src, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO / name).is_file():
            shutil.copy(DEMO / name, out / name)
    return out


@pytest.fixture
def window(qtbot, tmp_path):
    """A MainWindow with its own settings file, hardware detected (no GPU here: a preset) and a
    fixed host RAM measurement (24 of 32 GiB free)."""
    from PySide6.QtCore import QSettings

    from workbench.ui.app import make_app
    from workbench.ui.main_window import MainWindow

    make_app()
    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    win = MainWindow(settings=settings)
    win.resize(1400, 900)
    win.show()
    win.start_hardware()
    # Budgets from a fixed host measurement, not from this busy machine's RAM of the moment; a
    # guardrail question (a modal dialog) would hang an offscreen test: fail instead.
    win.telemetry_timer.stop()
    win.session.set_measured({"cpu": (32 << 30, 24 << 30)})
    win.confirm_load_anyway = lambda reason: pytest.fail(f"unexpected load guardrail: {reason}")
    yield win
    if win.job is not None:
        win.job.cancel.set()
        qtbot.waitUntil(lambda: win.job is None, timeout=20000)
    win.session.dirty = False  # no "save changes?" question at close
    win.close()
    win.deleteLater()
    qtbot.wait(10)
    gc.collect()  # free the window's Qt objects here, not in a later test's worker thread
