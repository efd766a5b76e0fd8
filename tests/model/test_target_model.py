"""The flat-token target runner against transformers' own forward, on tiny random Llama / Qwen2
/ Qwen3 models (fast) and on the default SmolLM2-135M-Instruct (slow)."""
import copy
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from dspark_serve.model.target_model import TargetModel
from dspark_serve.model.target_weights import load_weights
from dspark_serve.ops.quantized_linear import cpu_kernel
from dspark_serve.sampling.sampler import sample_from_probs

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                 original_max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "llama-mha-llama3-rope": lambda: LlamaConfig(**{**TINY, "num_key_value_heads": 4},
                                                 rope_parameters=LLAMA3_ROPE),
    "qwen2-yarn": lambda: Qwen2Config(**TINY, rope_parameters=YARN_ROPE),
    "qwen3-tied-bias": lambda: Qwen3Config(**TINY, head_dim=24, attention_bias=True,
                                           tie_word_embeddings=True),
}


def tiny_hf(name, seed=0):
    """A random tiny model whose norm weights and biases are far from their 1 / 0 init, so a
    skipped norm or bias shows in the logits."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "bias" in pname:
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_logits(hf, ids):
    """transformers' logits [len(ids), V] float32 for one sequence, no cache."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def plain_decode(model, prompts, max_new, *, chunk, num_slots, temperature=0.0, seed=0):
    """Plain continuous-batching decoding, a harness for the runner only: request i arrives
    at step i and waits for a free slot; each step runs, in one forward, up to ``chunk``
    prompt tokens of every prefilling request plus the last token of every decoding one.

    Returns (generated token lists, per-request logits [len(prompt) + max_new - 1, V] of all
    positions, the uniforms used per request). Asserts the cache's free capacity is back to
    its initial value at the end.
    """
    cache = model.new_kv_cache(num_slots, 128)
    initial_free = cache.free_tokens
    reqs = [dict(prompt=list(p), out=[], fed=0, slot=None, logits=[], u=[],
                 gen=torch.Generator().manual_seed(seed + i)) for i, p in enumerate(prompts)]
    step = 0
    while any(len(r["out"]) < max_new for r in reqs):
        for r in reqs[:step + 1]:
            if r["slot"] is None and not r["out"] and cache.num_free_slots:
                r["slot"] = cache.allocate()
        active = [r for r in reqs if r["slot"] is not None]
        ids, slots, positions, spans = [], [], [], []
        for r in active:
            seq = r["prompt"] + r["out"]
            start = r["fed"]
            stop = min(start + chunk, len(r["prompt"])) if start < len(r["prompt"]) else start + 1
            ids += seq[start:stop]
            slots += [r["slot"]] * (stop - start)
            positions += range(start, stop)
            spans.append((len(ids) - (stop - start), len(ids)))
            r["fed"] = stop
        out = model.forward(torch.tensor(ids), torch.tensor(slots), torch.tensor(positions), cache)
        for r, (a, b) in zip(active, spans):
            r["logits"].append(out.logits[a:b])
            if r["fed"] < len(r["prompt"]):
                continue
            last = out.logits[b - 1:b]
            if temperature == 0.0:
                token = int(last.argmax())
            else:
                u = torch.rand(1, generator=r["gen"])
                r["u"].append(u)
                token = int(sample_from_probs(torch.softmax(last / temperature, -1), u))
            r["out"].append(token)
            if len(r["out"]) == max_new:
                cache.free(r["slot"])
                r["slot"] = None
        step += 1
    assert cache.free_tokens == initial_free == cache.capacity_tokens
    return ([r["out"] for r in reqs], [torch.cat(r["logits"])[:len(r["prompt"]) + max_new - 1]
                                       for r in reqs], [r["u"] for r in reqs])


def check_against_hf(hf, prompts, outs, logits, atol):
    """Our logits at every position equal transformers' (teacher-forced on our output), and
    each greedy token is transformers' argmax given the same prefix: the greedy sequences
    are identical."""
    for prompt, out, ours in zip(prompts, outs, logits):
        ref = hf_logits(hf, list(prompt) + out[:-1])
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
        assert out == ref[len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_greedy_matches_transformers(name):
    hf = tiny_hf(name)
    model = TargetModel.from_hf(hf)
    prompts = [[5, 17, 3, 88, 40], list(range(20, 33)), [9, 2]]
    outs, logits, _ = plain_decode(model, prompts, 32, chunk=4, num_slots=2)
    check_against_hf(hf, prompts, outs, logits, atol=1e-4)


def test_tiny_sampled_matches_inverse_cdf_of_transformers():
    hf = tiny_hf("qwen3-tied-bias", seed=1)
    prompts = [[1, 2, 3], [50, 60, 70, 80, 90, 10]]
    outs, _, uniforms = plain_decode(TargetModel.from_hf(hf), prompts, 24, chunk=3,
                                     num_slots=2, temperature=0.8, seed=7)
    for prompt, out, u in zip(prompts, outs, uniforms):
        ref = hf_logits(hf, prompt + out[:-1])[len(prompt) - 1:]
        expected = sample_from_probs(torch.softmax(ref / 0.8, -1), torch.cat(u))
        assert out == expected.tolist()
    again, _, _ = plain_decode(TargetModel.from_hf(hf), prompts, 24, chunk=3, num_slots=2,
                               temperature=0.8, seed=7)
    assert again == outs


def test_taps_follow_deepspec_hooks():
    """Tap l is the output of decoder layer l (DeepSpec hooks ``layers[l]``), tap -1 the
    embedding output; for l < L-1 that is transformers' hidden_states[l + 1], and the last
    layer's tap is taken before the final norm (unlike hidden_states[-1])."""
    hf = tiny_hf("llama")
    ids = [4, 8, 15, 16, 23, 42]
    captured = {}
    hooks = [hf.model.embed_tokens.register_forward_hook(lambda m, i, o: captured.update({-1: o}))]
    for layer_id in (0, 2):
        hooks.append(hf.model.layers[layer_id].register_forward_hook(
            lambda m, i, o, layer_id=layer_id: captured.update({layer_id: o})))
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    model = TargetModel.from_hf(hf, target_layer_ids=[2, -1, 0])
    cache = model.new_kv_cache(1, 16)
    slot = cache.allocate()
    taps = model.forward(torch.tensor(ids), torch.full((6,), slot), torch.arange(6), cache).taps
    h = hf.config.hidden_size
    assert taps.shape == (6, 3 * h)
    for j, layer_id in enumerate((2, -1, 0)):
        torch.testing.assert_close(taps[:, j * h:(j + 1) * h], captured[layer_id][0],
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(taps[:, 2 * h:], hidden[1][0], atol=1e-5, rtol=0)
    assert not torch.allclose(taps[:, :h], hidden[3][0], atol=1e-2)


def test_logit_indices_select_rows_in_order():
    hf = tiny_hf("qwen2-yarn")
    model = TargetModel.from_hf(hf)
    cache = model.new_kv_cache(2, 16)
    slot = cache.allocate()
    ids = [7, 1, 30, 2, 9]
    out = model.forward(torch.tensor(ids), torch.full((5,), slot), torch.arange(5), cache,
                        logit_indices=torch.tensor([4, 0]))
    assert out.logits.shape == (2, 96) and out.logits.dtype == torch.float32
    assert out.taps.shape == (5, 0)
    torch.testing.assert_close(out.logits, hf_logits(hf, ids)[[4, 0]], atol=1e-4, rtol=0)


def test_bfloat16_close_to_float32_reference():
    hf = tiny_hf("qwen3-tied-bias")
    ids = list(range(3, 40))
    ref = hf_logits(hf, ids)
    model = TargetModel.from_hf(hf.to(torch.bfloat16))
    assert model.dtype == torch.bfloat16
    cache = model.new_kv_cache(1, 64)
    slot = cache.allocate()
    out = model.forward(torch.tensor(ids), torch.full((len(ids),), slot),
                        torch.arange(len(ids)), cache)
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, ref, atol=0.1, rtol=0.05)


def assert_logits_do_not_depend_on_batching(model):
    """A token's logits have the same bits however the step is composed: chunked prefill
    mixed with other requests' decode tokens, one request at a time, or a whole sequence in
    one forward (a verify block)."""
    prompts = [[5, 17, 3, 88, 40], list(range(20, 33)), [9, 2]]
    outs, logits, _ = plain_decode(model, prompts, 16, chunk=3, num_slots=3)
    alone_outs, alone_logits, _ = plain_decode(model, prompts, 16, chunk=64, num_slots=1)
    assert outs == alone_outs
    cache = model.new_kv_cache(1, 128)
    slot = cache.allocate()
    for prompt, out, mixed, alone in zip(prompts, outs, logits, alone_logits):
        assert torch.equal(mixed, alone)
        seq = prompt + out[:-1]
        block = model.forward(torch.tensor(seq), torch.full((len(seq),), slot),
                              torch.arange(len(seq)), cache).logits
        assert torch.equal(block, mixed)


@pytest.mark.parametrize("name", ["llama", "qwen3-tied-bias"])
def test_bfloat16_logits_do_not_depend_on_batching(name):
    """In bfloat16 (``assert_logits_do_not_depend_on_batching``)."""
    assert_logits_do_not_depend_on_batching(TargetModel.from_hf(tiny_hf(name).to(torch.bfloat16)))


def test_bfloat16_logits_do_not_depend_on_step_size():
    """A token's bfloat16 logits have the same bits when it is decoded alone, verified in a
    block of 8, run in one 200-token step next to a slot at a much larger position, or among
    many slots' tokens. The MLP's down projection has K = 3072, where oneDNN blocks the K
    reduction differently for calls of many rows (a few % of the rows change their last bit)
    unless the linears bound their rows per call."""
    config = LlamaConfig(**{**TINY, "hidden_size": 256, "intermediate_size": 3072,
                            "num_hidden_layers": 2, "max_position_embeddings": 1024})
    torch.manual_seed(3)
    model = TargetModel.from_hf(AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    n = 200
    seq = torch.randint(0, 96, (n,), generator=gen)

    def run(steps):
        """steps: lists of (slot, token ids, first position); returns slot 0's logits [n, V]
        in position order (the cache's other slots hold zeros or other requests' keys)."""
        cache = model.new_kv_cache(7, 1024)
        for _ in range(7):
            cache.allocate()
        rows = []
        for step in steps:
            slots = torch.cat([torch.full((len(t),), s) for s, t, _ in step])
            positions = torch.cat([torch.arange(p, p + len(t)) for _, t, p in step])
            logits = model.forward(torch.cat([t for _, t, _ in step]), slots, positions,
                                   cache).logits
            rows.append(logits[slots == 0])
        return torch.cat(rows)

    alone = run([[(0, seq[p:p + 1], p)] for p in range(n)])
    blocks = run([[(0, seq[p:p + 8], p)] for p in range(0, n, 8)])
    far = torch.randint(0, 96, (1,), generator=gen)
    one_step = run([[(1, far, 1000), (0, seq, 0)]])
    others = [(s, torch.randint(0, 96, (3 * s,), generator=gen), 40 * s) for s in range(2, 7)]
    many = run([[(0, seq[:n // 2], 0)] + others, [(0, seq[n // 2:], n // 2)] + others[::-1]])
    for logits in (blocks, one_step, many):
        assert torch.equal(logits, alone)


def page_layout_runs(model, seqs):
    """Two requests (seqs: two [300] token tensors) decoded in the same steps, on one page per
    slot and on an interleaved pool: (logits, logits, the pool's pages of each slot)."""

    def run(cache):
        slots = [cache.allocate(1), cache.allocate(1)]
        out = []
        for start, end in [(0, 100), (100, 101), (101, 108), (108, 300)]:
            for s in slots:
                assert cache.reserve(s, end)
            ids = torch.cat([seq[start:end] for seq in seqs])
            positions = torch.arange(start, end).repeat(2)
            out.append(model.forward(ids, torch.tensor(slots).repeat_interleave(end - start),
                                     positions, cache).logits)
        return torch.cat(out), [cache.pages_of(s) for s in slots]

    contiguous, _ = run(model.new_kv_cache(2, 320))
    paged, pages = run(model.new_kv_cache(2, 320, num_tokens=640))
    return contiguous, paged, pages


def test_bfloat16_logits_do_not_depend_on_the_page_layout():
    """A paged pool whose slots hold interleaved pages (attention gathers them) gives the
    bfloat16 logits of the one-page-per-slot cache bit for bit, step after step."""
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 1024})
    torch.manual_seed(4)
    model = TargetModel.from_hf(AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (300,), generator=gen) for _ in range(2)]
    contiguous, paged, pages = page_layout_runs(model, seqs)
    assert pages == [[0, 2, 4, 5, 6], [1, 3, 7, 8, 9]]
    assert torch.equal(paged, contiguous)


def test_rejects_unsupported_models():
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'"):
        load_weights(types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2")))
    sliding = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding-window"):
        TargetModel.from_hf(AutoModelForCausalLM.from_config(sliding))
    dynamic = LlamaConfig(**TINY, rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                       rope_theta=10000.0))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        TargetModel.from_hf(AutoModelForCausalLM.from_config(dynamic))
    with pytest.raises(ValueError, match="target_layer_ids"):
        TargetModel.from_hf(tiny_hf("llama"), target_layer_ids=[3])
    with pytest.raises(ValueError, match="dtype"):
        TargetModel.from_pretrained("unused", dtype="int8")


def test_forward_rejects_bad_inputs():
    model = TargetModel.from_hf(tiny_hf("llama"))
    cache = model.new_kv_cache(2, 8)
    slot = cache.allocate()
    one, pos = torch.tensor([slot]), torch.tensor([0])
    with pytest.raises(ValueError, match="token ids"):
        model.forward(torch.tensor([96]), one, pos, cache)
    with pytest.raises(ValueError, match="input_ids must be int64"):
        model.forward(torch.tensor([1], dtype=torch.int32), one, pos, cache)
    with pytest.raises(ValueError, match="logit_indices"):
        model.forward(torch.tensor([1]), one, pos, cache, logit_indices=torch.tensor([1]))
    with pytest.raises(ValueError, match="allocated"):
        model.forward(torch.tensor([1]), torch.tensor([1]), pos, cache)
    with pytest.raises(ValueError, match="positions"):
        model.forward(torch.tensor([1]), one, torch.tensor([8]), cache)


QUESTIONS = ["What is the capital of France?",
             "Write a Python function that checks whether a number is prime.",
             "Explain photosynthesis to a child in three sentences."]


@pytest.fixture
def one_thread():
    """Two OpenMP threads on a machine busy with other work spin at every barrier (steps
    5-30x slower); one thread keeps these tests' time predictable."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_model():
    """(path, transformers model in float32, chat prompts as token ids) of SmolLM2-135M."""
    from transformers import AutoTokenizer

    from dspark_serve.assets.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"]
               for q in QUESTIONS]
    return path, AutoModelForCausalLM.from_pretrained(path).eval(), prompts


@pytest.mark.slow
def test_default_model_float32_matches_transformers(default_model, one_thread):
    _, hf, prompts = default_model
    model = TargetModel.from_hf(hf)
    outs, logits, _ = plain_decode(model, prompts, 32, chunk=16, num_slots=2)
    check_against_hf(hf, prompts, outs, logits, atol=1e-3)


@pytest.mark.slow
def test_default_model_bfloat16_invariant_and_close(default_model, one_thread):
    """bfloat16: logits bit-identical between mixed decoding and one verify-style forward;
    against the float32 reference no farther than transformers' own bfloat16 on this CPU
    (whose bfloat16 rounding depends on the CPU): top-1 agreement >= 0.95 or within 0.02 of
    its (and >= 0.9), mean |diff| < 0.3. Measured on these sequences, ours / its:
    top-1 97-99 % / 97 % and mean |diff| 0.16-0.17 on AVX512-BF16 hosts; on an AVX2-only AMD
    EPYC 100 / 98.6 / 92.9 % against 97.1 / 97.3 / 91.4 %, |diff| 0.14 / 0.14 / 0.15 against
    0.17 / 0.18 / 0.16."""
    path, hf, prompts = default_model
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    model = TargetModel.from_pretrained(path, dtype="bfloat16")
    outs, logits, _ = plain_decode(model, prompts, 32, chunk=16, num_slots=2)
    cache = model.new_kv_cache(1, 128)
    slot = cache.allocate()
    for prompt, out, ours in zip(prompts, outs, logits):
        seq = prompt + out[:-1]
        block = model.forward(torch.tensor(seq), torch.full((len(seq),), slot),
                              torch.arange(len(seq)), cache).logits
        assert torch.equal(block, ours)
        ref, theirs = hf_logits(hf, seq), hf_logits(hf_bf16, seq).argmax(-1)
        top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean()
        assert top1 >= min(0.95, (theirs == ref.argmax(-1)).float().mean() - 0.02)
        assert top1 >= 0.9
        assert (ours - ref).abs().mean() < 0.3


@pytest.mark.slow
def test_default_model_int4_close_to_float32(default_model, one_thread):
    """``quantization="int4"`` serves the model's own Q4_1 grid. With torch's int4 kernel
    (bfloat16 activations) its next-token distributions are no farther from the float32
    reference than the bfloat16 target's (mean KL within 1.5x; measured on one prompt: 0.0016
    vs 0.0022 nats). With our kernel the activations are quantized to int8 per
    group of 32 as in llama.cpp (measured over these prompts: 0.0085 vs 0.0023 nats), within
    5x and 0.02 nats. Both agree with float32 on the top-1 token at >= 95 % of positions."""
    path, hf, prompts = default_model
    kl = {}
    for quantization in ("none", "int4"):
        model = TargetModel.from_pretrained(path, dtype="bfloat16", quantization=quantization)
        cache = model.new_kv_cache(1, 128)
        slot = cache.allocate()
        total, agree, count = 0.0, 0, 0
        for prompt in prompts:
            n = len(prompt)
            ours = model.forward(torch.tensor(prompt), torch.full((n,), slot), torch.arange(n),
                                 cache).logits.log_softmax(-1)
            ref = hf_logits(hf, prompt).log_softmax(-1)
            total += float((ref.exp() * (ref - ours)).sum(-1).sum())
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            count += n
        kl[quantization] = total / count
        assert agree / count >= 0.95, (quantization, agree / count)
    if cpu_kernel() is None:
        assert kl["int4"] <= 1.5 * kl["none"], kl
    else:
        assert kl["int4"] <= min(5 * kl["none"], 0.02), kl
