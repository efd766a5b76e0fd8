"""CUDA Markov sampler and Philox streams against the PyTorch references (issue 7 tolerances:
identical tokens given the same uniforms, probabilities within 1e-5 relative for fp32 and
1e-3 for 16-bit inputs, no NaN, every output element written). Plain unittest so the GPU
check script can run it where pytest is not installed; pytest sees the ``gpu`` marker."""
import unittest

import torch

from dspark_serve.bench.kernel_cases import boundary_safe_uniforms
from dspark_serve.drafter.block_sampler import sample_block
from dspark_serve.drafter.confidence_head import ConfidenceHead
from dspark_serve.drafter.markov_head import MarkovHead
from dspark_serve.ops import (cuda_ops_available, markov_sample, markov_sample_reference,
                              philox_uniforms)
from dspark_serve.types import SamplingTensors

try:
    import pytest
    pytestmark = pytest.mark.gpu
except ImportError:
    pass

SKIP = ("needs a CUDA device" if not torch.cuda.is_available() else None if cuda_ops_available()
        else "dspark_serve._C not built (python setup.py build_ext --inplace)")

# Per-row sampling: greedy, temperature only, top-k, top-p, min-p, all filters, top-k = 1.
CONFIGS = [(0.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 20, 1.0, 0.0), (1.0, 0, 0.8, 0.0),
           (1.0, 0, 1.0, 0.1), (1.3, 50, 0.9, 0.02), (0.9, 1, 1.0, 0.0)]
RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}


def make_case(rows, gamma, vocab, rank, d, dtype, seed):
    """Random non-zero inputs on the GPU (logits peaked like an LLM's), per-row sampling
    parameters, and uniforms that keep every draw away from CDF rounding ties."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        x = torch.randn(*shape, generator=g, device="cuda") * scale
        return torch.where(x == 0, 1e-3, x).to(dtype)

    cfg = [CONFIGS[i % len(CONFIGS)] for i in range(rows)]
    sampling = SamplingTensors(*(torch.tensor(col, device="cuda") for col in zip(*cfg)))
    case = dict(base_logits=randn(rows, gamma, vocab, scale=4.0), hidden=randn(rows, gamma, d),
                w1=randn(vocab, rank), w2=randn(vocab, rank, scale=rank ** -0.5),
                anchor=torch.randint(0, vocab, (rows,), generator=g, device="cuda"),
                sampling=sampling,
                uniforms=philox_uniforms(
                    torch.arange(rows, device="cuda") + seed,
                    torch.zeros(rows, dtype=torch.int64, device="cuda"), gamma),
                conf_weight=randn(d + rank), conf_bias=randn(1))
    case["uniforms"] = boundary_safe_uniforms(case["base_logits"], case["hidden"], case["w1"],
                                              case["w2"], case["anchor"], sampling, case["uniforms"])
    return case


def run_kernel(case, launch_mode, outputs=None):
    """Calls the op on poisoned outputs (or the given static ones) and returns them."""
    rows, gamma, vocab = case["base_logits"].shape
    if outputs is None:
        outputs = (torch.full((rows, gamma), -7, dtype=torch.int64, device="cuda"),
                   torch.full((rows, gamma, vocab), float("nan"), device="cuda"),
                   torch.full((rows, gamma), float("nan"), device="cuda"))
    s = case["sampling"]
    torch.ops.dspark.markov_sample(case["base_logits"], case["hidden"], case["w1"], case["w2"],
                                   case["conf_weight"], case["conf_bias"], case["anchor"],
                                   s.temperature, s.top_k, s.top_p, s.min_p, case["uniforms"],
                                   *outputs, launch_mode)
    return outputs


@unittest.skipIf(SKIP is not None, SKIP or "")
class MarkovKernelTest(unittest.TestCase):
    def check(self, case, outputs):
        tokens, probs, conf = outputs
        ref = markov_sample_reference(case["base_logits"], case["hidden"], case["w1"], case["w2"],
                                      case["anchor"], case["sampling"], case["uniforms"],
                                      case["conf_weight"], case["conf_bias"])
        self.assertFalse(bool(probs.isnan().any()) or bool(conf.isnan().any()))
        self.assertTrue(torch.equal(tokens, ref.tokens),
                        f"{int((tokens != ref.tokens).sum())} of {tokens.numel()} tokens differ")
        rtol = RTOL[case["base_logits"].dtype]
        torch.testing.assert_close(probs, ref.probs, rtol=rtol, atol=1e-7)
        torch.testing.assert_close(conf, ref.conf_logits, rtol=1e-4, atol=1e-4)

    def test_matches_reference(self):
        shapes = [(1, 5, 1000, 32), (3, 7, 4099, 256), (8, 16, 32003, 64), (130, 2, 2048, 16)]
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for i, (rows, gamma, vocab, rank) in enumerate(shapes):
                for mode in (1, 2):
                    with self.subTest(dtype=dtype, rows=rows, gamma=gamma, vocab=vocab, mode=mode):
                        case = make_case(rows, gamma, vocab, rank, 64, dtype, seed=i)
                        self.check(case, run_kernel(case, mode))

    def test_large_vocab(self):
        case = make_case(32, 7, 151936, 256, 256, torch.bfloat16, seed=11)
        self.check(case, run_kernel(case, 0))

    def test_cuda_graph_replay(self):
        case = make_case(4, 5, 4096, 32, 64, torch.bfloat16, seed=21)
        static = run_kernel(case, 0)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_kernel(case, 0, static)
        fresh = make_case(4, 5, 4096, 32, 64, torch.bfloat16, seed=22)
        for key in ("base_logits", "hidden", "w1", "w2", "anchor", "uniforms", "conf_weight",
                    "conf_bias"):
            case[key].copy_(fresh[key])
        graph.replay()
        torch.cuda.synchronize()
        self.check(case, static)

    def test_drafter_sample_block_runs_the_kernel(self):
        """The drafter's path (what the engine calls) reaches the kernel for a Markov head on
        the GPU: tokens equal the reference's, where the drafter's own modules would round the
        bias to bf16 and could pick other tokens."""
        case = make_case(6, 7, 4099, 64, 64, torch.bfloat16, seed=31)
        vocab, rank = case["w1"].shape
        head = MarkovHead(vocab, rank).to("cuda", torch.bfloat16)
        conf_head = ConfidenceHead(64, rank).to("cuda", torch.bfloat16)
        with torch.no_grad():
            head.markov_w1.weight.copy_(case["w1"])
            head.markov_w2.weight.copy_(case["w2"])
            conf_head.proj.weight.copy_(case["conf_weight"][None])
            conf_head.proj.bias.copy_(case["conf_bias"])
            block = sample_block(case["base_logits"], case["hidden"], case["anchor"], head,
                                 conf_head, case["sampling"], case["uniforms"])
        self.check(case, (block.tokens, block.probs, block.conf_logits))

    def test_rank_zero_falls_back_to_the_reference(self):
        case = make_case(3, 5, 1000, 16, 64, torch.bfloat16, seed=41)
        w0 = case["w1"][:, :0]
        block = markov_sample(case["base_logits"], case["hidden"], w0, w0, case["anchor"],
                              case["sampling"], case["uniforms"])
        ref = markov_sample_reference(case["base_logits"], case["hidden"], w0, w0,
                                      case["anchor"], case["sampling"], case["uniforms"])
        self.assertTrue(torch.equal(block.tokens, ref.tokens))


@unittest.skipIf(SKIP is not None, SKIP or "")
class PhiloxKernelTest(unittest.TestCase):
    def test_bitwise_equal_to_cpu(self):
        seed = torch.tensor([0, 1, -5, 2**62 + 7])
        offset = torch.tensor([0, 3, 2**40, 2**63 - 1])
        gpu = philox_uniforms(seed.cuda(), offset.cuda(), 37).cpu()
        self.assertTrue(torch.equal(gpu, philox_uniforms(seed, offset, 37)))


if __name__ == "__main__":
    unittest.main()
