"""The HF config synthesised from a GGUF file describes the same model: transformers built from it,
with the original weights, gives the original logits."""

from __future__ import annotations

import pytest

from tests.tiny_models import DENSE_CONFIGS, FAMILY_CONFIGS
from workbench.core.readers import open_model


@pytest.mark.parametrize("model_type", [*FAMILY_CONFIGS, *DENSE_CONFIGS])
def test_config_from_gguf_rebuilds_the_model(model_type, tiny_hf_model, tiny_gguf):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ref = tiny_hf_model(model_type)
    config = dict(open_model(tiny_gguf(model_type, "Q8_0")).config)
    assert config["eos_token_id"] == ref.config.eos_token_id and config["bos_token_id"] == ref.config.bos_token_id
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config),
                                             dtype=torch.float32).eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, ref.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
