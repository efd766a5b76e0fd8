"""Plugin registration inside an installed sglang 0.5.23 (CPU: imports only, no model runs)."""
import json
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang", reason="sglang not installed (pip install 'dspark-serve[sglang]')")

from dspark_serve.drafter.checkpoint import save_drafter  # noqa: E402
from dspark_serve.drafter.config import DSparkConfig  # noqa: E402
from dspark_serve.drafter.model import DSparkDrafter  # noqa: E402
from dspark_serve.scheduling.cost_table import CostTable  # noqa: E402
from dspark_serve.sglang_plugin import (ALGORITHM_NAME, DRAFTER_ARCHITECTURE,  # noqa: E402
                                        ENTRY_POINT_GROUP, ENTRY_POINT_NAME)
from dspark_serve.sglang_plugin.register import register  # noqa: E402
from dspark_serve.sglang_plugin.server_args import validate_server_args  # noqa: E402


@pytest.fixture(scope="module")
def registered():
    register()
    register()      # idempotent
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    return SpeculativeAlgorithm


def test_entry_point_discoverable():
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    assert len(eps) == 1 and eps[0].load() is register


def test_sglang_load_plugins_finds_and_runs_it(monkeypatch):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    assert GENERAL_PLUGINS_GROUP == ENTRY_POINT_GROUP
    func, _ = load_plugins_by_group(GENERAL_PLUGINS_GROUP)[ENTRY_POINT_NAME]
    assert func is register
    load_plugins()
    assert SpeculativeAlgorithm.from_string(ALGORITHM_NAME).name == ALGORITHM_NAME


def test_algorithm_registered(registered):
    from dspark_serve.sglang_plugin.spec_algo import DSparkServeSpecAlgo
    algo = registered.from_string("dspark_serve")
    assert type(algo) is DSparkServeSpecAlgo and algo.name == ALGORITHM_NAME
    assert algo.supports_overlap is True
    assert algo.need_topk() is False and algo.carries_draft_hidden_states() is False
    assert algo.is_dspark() and algo.supports_ragged_verify()
    assert algo.get_num_tokens_per_req_for_target_verify(8, True) == 7
    assert algo.validate_server_args is validate_server_args
    # Builtin DSPARK is untouched.
    assert registered.from_string("DSPARK") is registered.DSPARK


def test_future_map_factory_is_bound(registered):
    import inspect
    algo = registered.from_string(ALGORITHM_NAME)
    params = list(inspect.signature(algo.create_future_map).parameters)
    assert params == ["device", "req_to_token_pool", "needs_cpu_seq_lens",
                      "needs_confidence_relay"]


def test_create_worker_returns_our_worker(registered):
    from dspark_serve.sglang_plugin.worker import DSparkServeWorker
    from sglang.srt.speculative.dspark_components.dspark_worker_v2 import DSparkWorkerV2
    algo = registered.from_string(ALGORITHM_NAME)
    cls = algo.factory(None)
    assert cls is DSparkServeWorker and issubclass(cls, DSparkWorkerV2)


def test_drafter_in_model_registry(registered):
    from sglang.srt.models.dspark import Qwen3DSparkModel
    from sglang.srt.models.registry import ModelRegistry
    cls, arch = ModelRegistry.resolve_model_cls([DRAFTER_ARCHITECTURE])
    assert arch == DRAFTER_ARCHITECTURE and issubclass(cls, Qwen3DSparkModel)
    assert ModelRegistry.models["Qwen3DSparkModel"] is Qwen3DSparkModel


def _save_tiny_drafter(path):
    """A random 1-layer DSpark drafter (Markov rank 4, confidence head on [h; W1 x]) saved in
    the DeepSpec format."""
    cfg = DSparkConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=64,
                       block_size=4, mask_token_id=63, target_layer_ids=[0, 2],
                       num_target_layers=4, markov_rank=4, markov_head_type="vanilla",
                       enable_confidence_head=True, confidence_head_with_markov=True)
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False)
    save_drafter(DSparkDrafter(cfg, embed, head), path)


def _tiny_drafter(tmp_path):
    _save_tiny_drafter(tmp_path / "draft")
    CostTable((4, 8), (100.0, 40.0), 8).save(tmp_path / "sps.json")
    return SimpleNamespace(device="cuda", speculative_draft_model_path=str(tmp_path / "draft"),
                           speculative_num_draft_tokens=5,
                           speculative_dspark_sps_table_path=str(tmp_path / "sps.json"),
                           speculative_dspark_confidence_sts_path=None)


def test_drafter_loads_through_sglang_registry_on_cpu(registered, tmp_path, monkeypatch):
    """Our DeepSpec-format checkpoint -> SGLang's config loader -> the registry's class ->
    SGLang's ``load_weights``: every saved tensor lands in the parameter SGLang's draft
    forward reads (q/k/v and gate/up fused), nothing is left unloaded."""
    from safetensors.torch import load_file
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.hf_transformers.config import get_config

    path = tmp_path / "draft"
    _save_tiny_drafter(path)
    # What `serve --backend sglang` sets; SGLang builds the confidence head only then.
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "compact")
    # SGLang's RoPE module picks a CUDA/vLLM kernel unless it runs its CPU engine.
    monkeypatch.setattr(rope_base, "_is_cpu", True)
    hf = get_config(str(path), trust_remote_code=False)
    assert hf.model_type == "qwen3" and hf.architectures == ["Qwen3DSparkModel"]
    hf.architectures = [DRAFTER_ARCHITECTURE]    # what DSparkServeDraftTpWorker does
    cls, _ = ModelRegistry.resolve_model_cls(hf.architectures)
    with get_parallel().override(tp_size=1, tp_rank=0):
        model = cls(hf)
    model.load_weights(safetensors_weights_iterator([str(path / "model.safetensors")]))

    expected = load_file(str(path / "model.safetensors"))
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                         ("gate_up_proj", ("gate_proj", "up_proj"))):
        for name in [n for n in expected if n.endswith(f".{parts[0]}.weight")]:
            stem = name[:-len(f"{parts[0]}.weight")]
            expected[f"{stem}{fused}.weight"] = torch.cat(
                [expected.pop(f"{stem}{p}.weight") for p in parts])
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(expected)
    for name, param in params.items():
        assert torch.equal(param.detach(), expected[name].to(param.dtype)), name
    assert model.confidence_head.proj.in_features == 16 + 4


def test_server_args_validation(tmp_path):
    args = _tiny_drafter(tmp_path)
    validate_server_args(args, cuda_available=True)             # valid: gamma 4 -> 5 tokens
    with pytest.raises(ValueError, match="CUDA GPU"):
        validate_server_args(args, cuda_available=False)
    with pytest.raises(ValueError, match="num-draft-tokens 8"):
        validate_server_args(SimpleNamespace(**{**vars(args), "speculative_num_draft_tokens": 8}),
                             cuda_available=True)
    with pytest.raises(ValueError, match="draft-model-path"):
        validate_server_args(SimpleNamespace(**{**vars(args), "speculative_draft_model_path": None}),
                             cuda_available=True)
    with pytest.raises(ValueError, match="sps-table-path"):
        validate_server_args(SimpleNamespace(**{**vars(args),
                                                "speculative_dspark_sps_table_path": None}),
                             cuda_available=True)
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [1.0, 2.0]}))
    with pytest.raises(ValueError, match="2 temperatures"):
        validate_server_args(SimpleNamespace(**{**vars(args), "speculative_dspark_confidence_sts_path":
                                                str(tmp_path / "sts.json")}), cuda_available=True)


@pytest.mark.gpu
def test_worker_needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the worker builds SGLang model runners (on the CPU: "
                    "test_e2e_cpu.py; on a GPU: scripts/gpu_check.sh's SGLang section)")
