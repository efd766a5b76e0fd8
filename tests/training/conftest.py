"""Tiny random Llama target (through ``TargetModel``), a tiny DSpark/DFlash drafter on its
embedding and LM head, and a synthetic data folder of target-generated responses."""
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dspark_serve.drafter.config import DSparkConfig
from dspark_serve.drafter.model import DSparkDrafter
from dspark_serve.model.target_model import TargetModel
from dspark_serve.training.dataset import SEQUENCES_FILE, append_record
from dspark_serve.training.models import init_weights

VOCAB, HIDDEN, LAYERS, TAPS, MASK_ID = 64, 32, 4, [0, 2], 1


def make_target(seed: int = 0, device: str | None = None) -> TargetModel:
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True)).eval()
    with torch.no_grad():  # sharper target distributions than the 0.02 init gives
        hf.model.embed_tokens.weight.mul_(40.0)
    return TargetModel.from_hf(hf, device=device, target_layer_ids=TAPS)


def make_drafter(target: TargetModel, kind: str = "dspark", seed: int = 0,
                 block_size: int = 4) -> DSparkDrafter:
    dspark = kind == "dspark"
    cfg = DSparkConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                       block_size=block_size, mask_token_id=MASK_ID, target_layer_ids=TAPS,
                       num_target_layers=LAYERS, rope_theta=10000.0,
                       markov_rank=8 if dspark else 0, enable_confidence_head=dspark,
                       confidence_head_with_markov=dspark)
    drafter = DSparkDrafter(cfg, target.embed_tokens, target.lm_head)
    init_weights(drafter, seed)
    return drafter


@pytest.fixture
def target() -> TargetModel:
    return make_target()


def write_sequences(folder, n: int = 8, seed: int = 1, prompt_len: int = 5,
                    response_len: int = 20, target: TargetModel | None = None) -> None:
    """Synthetic records as gen-data writes them: random prompts answered greedily by the
    tiny target (``make_target()`` unless given), so CE and TV pull the same way."""
    target = target or make_target()
    g = torch.Generator().manual_seed(seed)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, SEQUENCES_FILE), "a", encoding="utf-8") as f:
        for i in range(n):
            ids = torch.randint(3, VOCAB, (prompt_len,), generator=g)
            cache = target.new_kv_cache(1, prompt_len + response_len)
            slot = cache.allocate()
            feed, pos = ids, torch.arange(prompt_len)
            response = []
            for _ in range(response_len):
                logits = target.forward(feed, torch.full_like(pos, slot), pos, cache).logits
                nxt = int(logits[-1].argmax())
                response.append(nxt)
                feed, pos = torch.tensor([nxt]), pos[-1:] + 1
            append_record(f, {"index": i, "prompt_ids": ids.tolist(), "response_ids": response,
                              "temperature": 0.0, "top_p": 1.0, "finish_reason": "length"})


@pytest.fixture(name="make_drafter")
def make_drafter_fixture():
    return make_drafter


@pytest.fixture(name="make_target")
def make_target_fixture():
    return make_target


@pytest.fixture(name="write_sequences")
def write_sequences_fixture():
    return write_sequences
