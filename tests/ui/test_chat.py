"""Chat dock: regenerate, edit and resend, folded reasoning, per-reply stats; Profile fills the grid."""

from __future__ import annotations

import numpy as np

from tests.ui.test_window import open_model
from workbench.ui.chat_dock import render_text


def load(window, qtbot, path):
    open_model(window, qtbot, path)
    window.apply_placement()
    qtbot.waitUntil(lambda: window.session.engine is not None and window.job is None, timeout=60000)


def answer(window, qtbot):
    qtbot.waitUntil(lambda: window.chat_dock.busy or window.job is not None, timeout=10000)
    qtbot.waitUntil(lambda: window.job is None and not window.chat_dock.busy, timeout=60000)


def test_regenerate_and_edit_and_resend(window, qtbot, chat_model_dir):
    load(window, qtbot, chat_model_dir)
    s, chat = window.session, window.chat_dock
    s.set_chat_settings(sampling={"temperature": 0.0, "max_new": 24})
    chat.input.setPlainText("Where is Longbourn?")
    chat.send()
    answer(window, qtbot)
    first = s.chat.messages[-1]
    assert [m.role for m in s.chat.messages] == ["user", "assistant"]
    assert first.stats["tokens"] >= 1 and first.stats["stop_reason"] in ("eos", "max_tokens")
    assert first.stats["context_max"] == s.engine.max_context

    chat.regenerate()  # greedy: the same answer again, in place of the first
    answer(window, qtbot)
    assert [m.role for m in s.chat.messages] == ["user", "assistant"]
    assert s.chat.messages[-1].content == first.content

    chat._on_anchor(type("U", (), {"toString": lambda self: "edit:0"})())
    assert chat.input.toPlainText() == "Where is Longbourn?"
    chat.input.setPlainText("Who is Mr. Bennet?")
    chat.send()
    answer(window, qtbot)
    assert [m.role for m in s.chat.messages] == ["user", "assistant"]
    assert s.chat.messages[0].content == "Who is Mr. Bennet?"
    assert "Who is Mr. Bennet?" in chat.transcript.toPlainText()
    t, tps = s.tokens_per_s_series()
    assert len(t) > 0 and np.nanmax(tps) > 0  # the performance plot has measured tokens/s


def test_template_override_changes_the_prompt(window, qtbot, chat_model_dir):
    load(window, qtbot, chat_model_dir)
    s = window.session
    runtime = s.chat_runtime()
    from workbench.session.chat import conversation

    s.add_message("user", "Hello")
    default = runtime.prompt_ids(conversation(s.chat))
    s.set_chat_settings(template_override="{% for m in messages %}{{ m.content }}\n{% endfor %}")
    assert runtime.prompt_ids(conversation(s.chat), s.chat.template_override) != default
    assert window.chat_dock.template.toPlainText() == s.chat.template_override


def test_reasoning_blocks_fold():
    text = "<think>first I consider the weather</think>It rains."
    folded = render_text(text, set(), "3")
    assert "reasoning (5 words)" in folded and "consider" not in folded and "It rains." in folded
    unfolded = render_text(text, {"3.0"}, "3")
    assert "consider the weather" in unfolded
    assert "reasoning…" in render_text("<think>still thinking", set(), "live")


def test_profile_fills_the_grid_with_routing_frequencies(window, qtbot, chat_model_dir):
    open_model(window, qtbot, chat_model_dir)
    s = window.session
    assert np.isnan(s.frequency_grid()).all()
    hint = window.experts.selection_label.text
    assert "Run ▸ Profile" in hint()  # an unprofiled grid says how to colour it
    window.profile()  # loads the engine first, then runs the calibration prompts
    qtbot.waitUntil(lambda: s.stats is not None and window.job is None, timeout=120000)
    f = s.frequency_grid()
    assert np.isfinite(f).all()
    assert np.allclose(f.mean(axis=1), 1.0)  # per layer, relative to that layer's average
    assert s.stats.counts[s.moe_layers].sum() > 0
    assert "Profiled routing" in window.status_label.text()
    assert "Run ▸ Profile" not in hint() and hint().startswith("Select experts")
