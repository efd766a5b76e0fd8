"""The CPU harness's own logic, without a server: the torch chain rejection sampler that
replaces SGLang's Triton accept, and the guard that stops a patch whose target moved.
Loaded by file path: putting ``cpu_harness/site`` on this process's path would expose the
harness plugin and the ``sgl_kernel`` stand-in to every other test."""
import importlib.util
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parent / "cpu_harness" / "site" / "dspark_sglang_cpu_harness"


def _load(module: str):
    spec = importlib.util.spec_from_file_location(f"_cpu_harness_{module}", PACKAGE / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


sampling = _load("chain_sampling")
patching = _load("patching")


def _sample(candidates, target, draft, uniforms, final_uniforms):
    """Run the sampler on chain buffers as SGLang lays them out (retrive_index = flat slot)."""
    bs, slots = candidates.shape
    retrive_index = torch.arange(bs * slots).view(bs, slots)
    predicts = torch.full((bs * slots,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, slots), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    sampling.chain_speculative_sampling(
        predicts, accept_index, accept_num, candidates, retrive_index, None, None, uniforms,
        final_uniforms, target, draft, 1.0, 1.0, True)
    return predicts.view(bs, slots), accept_index, accept_num


def test_accepts_while_u_times_q_below_p_then_samples_the_residual():
    # V = 3, gamma = 2; drafts 1 then 2.
    candidates = torch.tensor([[0, 1, 2], [0, 1, 2]])
    target = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.0, 0.0, 1.0]]).expand(2, 3, 3)
    draft = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]).expand(2, 2, 3)
    # Row 0: u1 * 1 < .5 accepts draft 1, u2 * 1 >= .8 rejects draft 2; residual at row 1 is
    # max(p - q, 0) = [.1, .1, 0], the final uniform .75 picks token 1.
    # Row 1: both accepted; the bonus comes from target row 2 (token 2 only).
    uniforms = torch.tensor([[0.4, 0.9], [0.1, 0.5]])
    predicts, accept_index, accept_num = _sample(candidates, target, draft, uniforms,
                                                 torch.tensor([0.75, 0.3]))
    assert accept_num.tolist() == [1, 2]
    assert accept_index.tolist() == [[0, 1, -1], [3, 4, 5]]
    assert predicts.tolist() == [[1, 1, -1], [1, 2, 2]]


def test_first_token_follows_the_target_distribution():
    """Lossless: whatever the draft, the token after the prefix is distributed as p."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 40000, 5
    p = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    candidates = torch.stack([torch.zeros(n, dtype=torch.long), drafts], dim=1)
    target = p.expand(n, 2, vocab)
    draft = q.expand(n, 1, vocab)
    predicts, _, _ = _sample(candidates, target, draft, torch.rand(n, 1, generator=gen),
                             torch.rand(n, generator=gen))
    freq = torch.bincount(predicts[:, 0].long(), minlength=vocab).float() / n
    # 4.5 standard errors of the largest cell (sqrt(.24 / 40000) = .0024).
    assert torch.allclose(freq, p, atol=0.011), freq


def test_block_verification_is_refused():
    with pytest.raises(NotImplementedError):
        sampling.chain_speculative_sampling(*[None] * 14, block_verification=True)


def test_patch_guard_fails_loudly_when_the_target_moved(tmp_path):
    source = tmp_path / "fake_sglang_module.py"
    source.write_text("def target(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("fake_sglang_module", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(patching.TargetMoved, match="no longer contains"):
        patching.replace(module, "target", lambda f: f, anchors=("return x + 2",))
    with pytest.raises(patching.TargetMoved, match="is gone"):
        patching.replace(module, "renamed", lambda f: f)
    patching.replace(module, "target", lambda f: lambda x: f(x) * 10, anchors=("return x + 1",))
    patching.replace(module, "target", lambda f: lambda x: f(x) * 10, anchors=("return x + 1",))
    assert module.target(1) == 20       # patched once, not twice


def test_harness_is_not_visible_to_this_process():
    """Only the server processes put the harness on their path: the main install must not
    discover its plugin or the sgl_kernel stand-in."""
    from importlib.metadata import entry_points

    assert not [ep for ep in entry_points(group="sglang.srt.plugins")
                if ep.name == "dspark_cpu_harness"]
