"""``workbench generate`` end to end on a tiny model with a real tokenizer: HF folder and GGUF copy,
every placement option, streaming and --json output, and the user errors."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.engine_helpers import reference_tokens
from tests.engine.test_tokenizer_helpers import build_tiny_chat_model
from workbench.cli import main
from workbench.core.placement import CPU_STREAM, Placement
from workbench.engine.tokenizer import load_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("generate_cli")
    hf = build_tiny_chat_model(folder)
    (folder / "chat_template.jinja").write_text(CHATML)
    # The GGUF writer copies the template from tokenizer_config.json into tokenizer.chat_template.
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "top_p": 0.9}))
    yield hf, folder, load_tokenizer(folder)
    torch.set_num_threads(threads)


def run_json(capsys, *argv) -> dict:
    assert main(["generate", *map(str, argv), "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_prompt_ids_json_equals_transformers(model, capsys):
    hf, folder, _ = model
    out = run_json(capsys, folder, "--prompt-ids", "5,17,33,8", "--max-new", 12, "--greedy", "--ignore-eos")
    assert out["tokens"] == reference_tokens(hf, [5, 17, 33, 8], 12)
    assert out["stop_reason"] == "max_tokens"
    assert out["timings"]["decode_tokens_per_s"] > 0 and out["timings"]["ttft_s"] > 0


def test_prompt_streams_text_and_summary(model, capsys):
    hf, folder, tok = model
    assert main(["generate", str(folder), "--prompt", "The experts", "--max-new", "10", "--greedy",
                 "--ignore-eos", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    expected = reference_tokens(hf, tok.encode("The experts"), 10)
    assert captured.out == tok.decode(expected) + "\n"
    assert "[max_tokens: 10 tokens" in captured.err and "decode" in captured.err


def test_chat_uses_the_chat_template(model, capsys):
    hf, folder, tok = model
    out = run_json(capsys, folder, "--chat", "Hi", "--system", "Be brief", "--max-new", 6, "--greedy",
                   "--ignore-eos")
    text = "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out["tokens"] == reference_tokens(hf, tok.encode(text, add_special_tokens=False), 6)


@pytest.mark.parametrize("flags", [
    ["--cpu-moe"],
    ["--n-cpu-moe", "2", "--expert-mode", "stream", "--stream-slots", "1"],
    ["--cpu-moe", "--expert-mode", "stream"],
])
def test_placement_flags_give_the_same_tokens(model, capsys, flags):
    hf, folder, _ = model
    out = run_json(capsys, folder, "--prompt-ids", "9,8,7", "--max-new", 8, "--greedy", "--ignore-eos", *flags)
    assert out["tokens"] == reference_tokens(hf, [9, 8, 7], 8)


def test_placement_from_a_project_file(model, capsys, tmp_path):
    from workbench.core.project import save_project
    from workbench.core.readers import open_model

    hf, folder, _ = model
    inv = open_model(folder)
    placement = Placement(stream_slots=2)
    placement.move(inv.expert_keys()[::2], CPU_STREAM)
    project = tmp_path / "project.json"
    save_project(project, inv, placement)
    out = run_json(capsys, folder, "--placement", project, "--prompt-ids", "9,8,7", "--max-new", 8, "--greedy",
                   "--ignore-eos")
    assert out["tokens"] == reference_tokens(hf, [9, 8, 7], 8)


def test_gguf_copy_with_its_own_tokenizer(model, capsys, tmp_path):
    from workbench.core.gguf_writer import write_gguf

    hf, folder, tok = model
    gguf_path = write_gguf(folder, tmp_path / "tiny.gguf", "F32")[0]
    out = run_json(capsys, gguf_path, "--prompt", "The experts", "--max-new", 8, "--greedy", "--ignore-eos")
    assert out["tokens"] == reference_tokens(hf, tok.encode("The experts"), 8)
    assert out["text"] == tok.decode(out["tokens"])
    from_folder = run_json(capsys, folder, "--chat", "Hi", "--max-new", 6, "--greedy", "--ignore-eos")
    from_gguf = run_json(capsys, gguf_path, "--chat", "Hi", "--max-new", 6, "--greedy", "--ignore-eos")
    assert from_gguf["tokens"] == from_folder["tokens"]


def test_eos_and_stop_string_end_generation(model, capsys):
    hf, folder, tok = model
    free = run_json(capsys, folder, "--prompt-ids", "5,6", "--max-new", 10, "--greedy", "--ignore-eos")
    first_text = tok.decode(free["tokens"][:1])
    out = run_json(capsys, folder, "--prompt-ids", "5,6", "--max-new", 10, "--greedy", "--ignore-eos",
                   "--stop", first_text)
    assert out["stop_reason"] == "stop_string" and out["text"] == "" and len(out["tokens"]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", ",".join(["5"] * 10), "--ctx", "8"], "prompt has 10 tokens but the context holds 8"),
    ([], "give a prompt"),
    (["--prompt-ids", "a,b"], "comma-separated integers"),
    (["--prompt-ids", "1", "--placement", "/nonexistent/project.json"], "no project file"),
    (["--prompt-ids", "1", "--n-cpu-moe", "-1"], "layer count"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
])
def test_user_errors_are_one_clear_line(model, capsys, argv, message):
    _, folder, _ = model
    assert main(["generate", str(folder), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("workbench generate: ") and message in err and "Traceback" not in err


def test_sampling_flags_override_the_generation_config(model):
    from workbench.cli import _build_parser
    from workbench.commands.generate import _sampling
    from workbench.core.readers import open_model

    inv = open_model(model[1])

    def params(*flags):
        argv = ["generate", str(model[1]), *flags]
        return _sampling(_build_parser(argv).parse_args(argv), inv)

    p = params()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.is_greedy) == (0.6, 20, 0.9, 0.05, 1.0, False)
    p = params("--temperature", "1.2", "--top-k", "0", "--min-p", "0", "--repeat-penalty", "1.1", "--seed", "3")
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == (1.2, 0, 0.9, 0.0, 1.1, 3)
    assert params("--greedy").is_greedy


def test_load_progress_line(capsys):
    from workbench.commands.generate import _load_progress

    progress = _load_progress()
    progress(0, 2048, "(None, 'embed', None)")
    progress(1024, 2048, "skipped: too soon")
    progress(2048, 2048, "lm_head")
    err = capsys.readouterr().err
    assert "loading   0.0% (0 B of 2.0 KiB)" in err and "100.0%" in err and "too soon" not in err
    assert err.endswith("\n")
