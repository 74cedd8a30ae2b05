"""Chat with the loaded engine: render the conversation with the model's chat template (or the
user's override), generate with streaming, and measure each reply.

Blocking functions, meant for a worker thread; they emit ``generation_token`` from that thread and
return the reply without touching the conversation (the GUI thread appends it).
"""

from __future__ import annotations

import logging
import threading
import time

from workbench.core.errors import WorkbenchError

log = logging.getLogger(__name__)


class ChatRuntime:
    """What generating needs besides the engine: tokenizer, template, Generator (one per engine)."""

    def __init__(self, engine, inventory):
        from workbench.engine.chat_template import load_chat_template
        from workbench.engine.generate import Generator
        from workbench.engine.tokenizer import tokenizer_for

        self.engine = engine
        self.tokenizer = tokenizer_for(inventory)
        if self.tokenizer is None:
            raise WorkbenchError(f"{inventory.path.name} has no tokenizer: chat needs one")
        self.model_template = load_chat_template(
            inventory.path, self.tokenizer.special_tokens,
            gguf_fields=inventory.metadata if inventory.format == "gguf" else None,
        )
        self.generator = Generator(engine, self.tokenizer)

    def template(self, override: str):
        from workbench.engine.chat_template import ChatTemplate

        if override.strip():
            return ChatTemplate(override, self.tokenizer.special_tokens, "override")
        return self.model_template

    def prompt_ids(self, messages: list[dict], override: str = "") -> list[int]:
        """Token ids of the conversation with the assistant's turn opened."""
        template = self.template(override)
        if template is None:  # no template anywhere: plain "role: text" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.tokenizer.encode(text)
        return self.tokenizer.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)


def conversation(chat) -> list[dict]:
    """The messages the template sees: the system prompt (if any) then every turn."""
    out = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt.strip() else []
    out += [{"role": m.role, "content": m.content} for m in chat.messages if m.role != "system"]
    return out


def sampling_params(settings: dict):
    from workbench.engine.sampling import SamplingParams

    temperature = float(settings.get("temperature", 0.7))
    return SamplingParams(
        temperature=temperature,
        top_k=int(settings.get("top_k", 0)),
        top_p=float(settings.get("top_p", 1.0)),
        min_p=float(settings.get("min_p", 0.0)),
        repetition_penalty=float(settings.get("repeat_penalty", 1.0)),
        seed=settings.get("seed"),
        greedy=temperature == 0,
    )


def generate_reply(session, cancel: threading.Event):
    """The assistant's answer to the conversation (a ChatMessage with its stats). Blocking."""
    from workbench.session import ChatMessage

    if session.engine is None:
        session.load_engine(cancel=cancel)
    engine = session.engine
    runtime = session.chat_runtime()
    chat = session.chat
    ids = runtime.prompt_ids(conversation(chat), chat.template_override)
    room = engine.max_context - len(ids) - 1
    if room < 1:
        raise WorkbenchError(
            f"the conversation has {len(ids)} tokens and the context holds {engine.max_context}: "
            "start a new chat or delete earlier messages"
        )
    max_new = max(1, min(int(chat.sampling.get("max_new", 256)), room))
    params = sampling_params(chat.sampling)
    state = {"n": 0, "first": None}
    session.events.generation_started.emit()

    def on_token(_token_id: int, delta: str) -> None:
        now = time.perf_counter()
        state["n"] += 1
        if state["first"] is None:
            state["first"] = now
        elapsed = now - state["first"]
        tps = (state["n"] - 1) / elapsed if elapsed > 0 else 0.0
        session.note_tokens_per_s(tps)
        session.events.generation_token.emit(delta, tps)

    result = runtime.generator.generate(ids, max_new_tokens=max_new, sampling=params, on_token=on_token,
                                        cancel=cancel)
    t = result.timings
    stats = {
        "ttft_s": t.ttft_s,
        "prefill_tps": t.prefill_tokens_per_s,
        "decode_tps": t.decode_tokens_per_s,
        "prompt_tokens": t.prompt_tokens,
        "tokens": t.generated_tokens,
        "stop_reason": result.stop_reason,
        "context_used": len(ids) + t.generated_tokens,
        "context_max": engine.max_context,
    }
    return ChatMessage("assistant", result.text, stats)
