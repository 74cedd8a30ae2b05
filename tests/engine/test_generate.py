"""Generation on the real engine with a tiny Qwen3-MoE and a real byte-level tokenizer.

Greedy tokens equal transformers' generate; every stop reason (eos, stop string, max tokens,
context full, cancel from another thread); seeded sampling; the chat-turn KV prefix reuse.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.engine.engine_helpers import (
    TEST_DEVICE,
    TEST_DTYPE,
    greedy_tokens,
    open_inventory,
    reference_tokens,
)
from tests.engine.test_tokenizer_helpers import build_tiny_chat_model
from workbench.core.errors import WorkbenchError
from workbench.engine.chat_template import ChatTemplate
from workbench.engine.engine import Engine
from workbench.engine.generate import Generator, chat_prompt_ids, default_eos_ids
from workbench.engine.sampling import SamplingParams
from workbench.engine.tokenizer import load_tokenizer

GREEDY = SamplingParams(greedy=True)
PROMPT = "The router picks the top-k experts"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(transformers model, folder with weights + tokenizer.json, our Tokenizer)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("qwen3_moe_tok")
    model = build_tiny_chat_model(folder)
    (folder / "generation_config.json").write_text('{"eos_token_id": [7, 322], "do_sample": false}')
    return model, folder, load_tokenizer(folder)


@pytest.fixture(scope="module")
def engine(model):
    return Engine.load(open_inventory(model[1]), device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=256)


def expected(model, engine, gen, ids: list[int], n: int) -> list[int]:
    """Greedy reference: transformers' generate in fp32; in bf16 on a GPU (where near-ties may flip)
    the engine's own step-by-step greedy loop, after which the generator's cache is stale."""
    if TEST_DTYPE == torch.float32:
        return reference_tokens(model[0], ids, n)
    out = greedy_tokens(engine, ids, n)
    gen.reset_cache()
    return out


@pytest.fixture()
def gen(engine, model):
    g = Generator(engine, model[2])
    g.reset_cache()
    return g


def test_greedy_tokens_equal_transformers_generate(gen, model):
    ids = gen.encode(PROMPT)
    result = gen.generate(PROMPT, max_new_tokens=32, sampling=GREEDY, ignore_eos=True)
    assert result.tokens == expected(model, gen.engine, gen, ids, 32)
    assert result.stop_reason == "max_tokens" and len(result.tokens) == 32
    assert result.text == model[2].decode(result.tokens)
    t = result.timings
    assert t.prompt_tokens == len(ids) and t.generated_tokens == 32 and t.reused_tokens == 0
    assert 0 < t.ttft_s == t.prefill_s and t.decode_s > 0
    assert t.prefill_tokens_per_s > 0 and t.decode_tokens_per_s > 0
    assert set(result.to_dict()) == {"tokens", "text", "stop_reason", "timings"}


def test_stream_and_callback_agree_with_the_result(gen):
    stream = gen.stream(PROMPT, max_new_tokens=20, sampling=GREEDY, ignore_eos=True)
    events = list(stream)
    assert [e.token_id for e in events] == stream.result.tokens
    assert "".join(e.text for e in events) == stream.result.text
    seen = []
    again = gen.generate(PROMPT, max_new_tokens=20, sampling=GREEDY, ignore_eos=True,
                         on_token=lambda tok, text: seen.append((tok, text)))
    assert seen == [(e.token_id, e.text) for e in events] and again.tokens == stream.result.tokens


def test_eos_stops_and_is_kept_in_tokens_only(gen, engine, model):
    free = gen.generate(PROMPT, max_new_tokens=12, sampling=GREEDY, ignore_eos=True).tokens
    eos = free[4]
    first = free.index(eos)
    result = Generator(engine, model[2], eos_ids=[eos]).generate(PROMPT, max_new_tokens=12, sampling=GREEDY)
    assert result.stop_reason == "eos"
    assert result.tokens == free[:first + 1]
    assert result.text == model[2].decode(free[:first])


def test_default_eos_ids_come_from_config_and_tokenizer(engine, model):
    tok = model[2]
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end == 322  # config.json's eos_token_id
    assert default_eos_ids(engine.inventory, tok) == [7, 322]  # + generation_config.json's list
    assert Generator(engine, tok).eos_ids == {7, 322}


def test_stop_string_across_token_boundaries(gen, model):
    sampled = SamplingParams(temperature=1.0, seed=5)  # seeded: varied, reproducible text
    free = gen.stream(PROMPT, max_new_tokens=24, sampling=sampled, ignore_eos=True)
    events = list(free)
    text = free.result.text
    # A stop string made of the end of one token's text and the start of the next one's.
    i = next(i for i in range(1, len(events) - 1) if events[i].text and events[i + 1].text
             and "\ufffd" not in events[i].text + events[i + 1].text)
    cut = sum(len(e.text) for e in events[:i + 1])
    stop = text[cut - min(2, len(events[i].text)):cut + min(2, len(events[i + 1].text))]
    stream = gen.stream(PROMPT, max_new_tokens=24, sampling=sampled, ignore_eos=True, stop=["NEVER", stop])
    deltas = [e.text for e in stream]
    result = stream.result
    assert result.stop_reason == "stop_string"
    assert result.text == text[:text.find(stop)]
    assert "".join(deltas) == result.text
    assert result.tokens == free.result.tokens[:len(result.tokens)]


def test_context_full_and_prompt_too_long(model):
    engine = Engine.load(open_inventory(model[1]), device=TEST_DEVICE, dtype=TEST_DTYPE, max_context=12)
    gen = Generator(engine, model[2])
    prompt = [5, 6, 7, 8, 9]
    result = gen.generate(prompt, max_new_tokens=100, sampling=GREEDY, ignore_eos=True)
    assert result.stop_reason == "context_full" and len(result.tokens) == 12 - len(prompt)
    assert result.tokens == expected(model, gen.engine, gen, prompt, len(result.tokens))
    with pytest.raises(WorkbenchError, match="prompt has 12 tokens but the context holds 12"):
        gen.generate(list(range(3, 15)), max_new_tokens=4)
    with pytest.raises(WorkbenchError, match="outside the vocabulary"):
        gen.generate([1, 10**6], max_new_tokens=4)
    with pytest.raises(WorkbenchError, match="empty"):
        gen.generate([], max_new_tokens=4)


def test_cancel_from_another_thread_stops_within_one_token(gen):
    reached, resume = threading.Event(), threading.Event()
    tokens_at_cancel = []

    def on_token(token_id, text):
        n = len(seen)
        seen.append(token_id)
        if n == 4:  # the 5th token: let the main thread cancel, then carry on
            reached.set()
            resume.wait(10)

    seen: list[int] = []
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", gen.generate(
        PROMPT, max_new_tokens=200, sampling=GREEDY, ignore_eos=True, on_token=on_token)))
    worker.start()
    assert reached.wait(30)
    tokens_at_cancel.append(len(seen))
    gen.cancel()
    resume.set()
    worker.join(30)
    result = out["r"]
    assert result.stop_reason == "cancelled"
    assert len(result.tokens) <= tokens_at_cancel[0] + 1
    # A cancel arriving between generations does not leak into the next one.
    assert gen.generate(PROMPT, max_new_tokens=3, sampling=GREEDY, ignore_eos=True).stop_reason == "max_tokens"


def test_cancel_event_argument(gen):
    event = threading.Event()
    result = gen.generate(PROMPT, max_new_tokens=50, sampling=GREEDY, ignore_eos=True, cancel=event,
                          on_token=lambda tok, text: event.set())
    assert result.stop_reason == "cancelled" and len(result.tokens) == 1


def test_seeded_sampling_is_reproducible(gen):
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=11)
    a = gen.generate(PROMPT, max_new_tokens=16, sampling=params, ignore_eos=True).tokens
    b = gen.generate(PROMPT, max_new_tokens=16, sampling=params, ignore_eos=True).tokens
    c = gen.generate(PROMPT, max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=12),
                     ignore_eos=True).tokens
    assert a == b and a != c


def test_next_turn_reuses_the_cached_prefix(gen, model):
    first = gen.generate(PROMPT, max_new_tokens=8, sampling=GREEDY, ignore_eos=True)
    ids = gen.encode(PROMPT) + first.tokens + gen.encode(" and more", add_special_tokens=False)
    second = gen.generate(ids, max_new_tokens=10, sampling=GREEDY, ignore_eos=True)
    assert second.timings.reused_tokens == len(gen.encode(PROMPT)) + len(first.tokens) - 1
    # A prompt that diverges early reuses only the common part.
    other = [ids[0], 77, 78, 79]
    third = gen.generate(other, max_new_tokens=6, sampling=GREEDY, ignore_eos=True)
    assert third.timings.reused_tokens == 1
    assert second.tokens == expected(model, gen.engine, gen, ids, 10)
    assert third.tokens == expected(model, gen.engine, gen, other, 6)


def test_chat_prompt_ids(gen, model):
    template = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ids = chat_prompt_ids(model[2], template, [{"role": "user", "content": "Hi"}])
    assert ids[0] == model[2].token_to_id("<|im_start|>")
    result = gen.generate(ids, max_new_tokens=4, sampling=GREEDY, ignore_eos=True)
    assert result.tokens == expected(model, gen.engine, gen, ids, 4)


def test_abandoned_stream_frees_the_generator(gen, model):
    stream = gen.stream(PROMPT, max_new_tokens=20, sampling=GREEDY, ignore_eos=True)
    events = iter(stream)
    first = [next(events).token_id for _ in range(3)]
    with pytest.raises(WorkbenchError, match="already generating"):
        gen.generate(PROMPT, max_new_tokens=2)
    stream.close()
    assert stream.result is None
    # The cache still holds the abandoned run's prefix, so the continuation reuses it.
    ids = gen.encode(PROMPT) + first
    result = gen.generate(ids, max_new_tokens=5, sampling=GREEDY, ignore_eos=True)
    assert result.timings.reused_tokens == len(ids) - 1
    assert result.tokens == expected(model, gen.engine, gen, ids, 5)


def test_direct_engine_use_in_between_invalidates_the_cached_prefix(gen, engine, model):
    first = gen.generate(PROMPT, max_new_tokens=6, sampling=GREEDY, ignore_eos=True)
    greedy_tokens(engine, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)  # e.g. a routing profile run
    ids = gen.encode(PROMPT) + first.tokens
    again = gen.generate(ids, max_new_tokens=6, sampling=GREEDY, ignore_eos=True)
    assert again.timings.reused_tokens == 0
    assert again.tokens == expected(model, engine, gen, ids, 6)


def test_chunked_prefill_gives_the_same_tokens(engine, model):
    gen = Generator(engine, model[2], prefill_chunk=3)
    ids = gen.encode(PROMPT)
    assert len(ids) > 6
    result = gen.generate(ids, max_new_tokens=8, sampling=GREEDY, ignore_eos=True)
    assert result.tokens == expected(model, engine, gen, ids, 8)
