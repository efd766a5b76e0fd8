"""Markov head (paper Eq 5): a low-rank first-order transition bias added to the base logits.

B(x_{k-1}, .) = W1[x_{k-1}] W2 with W1 in R^{V x r} (an embedding table, ``markov_w1``) and
W2 in R^{r x V} (a bias-free logit projection, ``markov_w2``, stored as nn.Linear weight
[V, r]; [N, r] over a pruned draft vocabulary of N tokens, while W1 keeps all V rows because
x_{k-1} may be any target token); tensor names as DeepSpec's ``deepspec/modeling/dspark/markov_head.py::VanillaMarkov``.
x_0 is the anchor token: position 1's bias conditions on it. Also DeepSpec's gated variant
(``markov_head_type: gated``): B = W2 (sigma(gate_proj[h_k; W1[x_{k-1}]]) * W1[x_{k-1}]).

Every sequential head shares one step interface, used by ``block_sampler``:
``init_state(batch_shape, like)`` and ``step(state, prev_tokens, hidden) -> (state, bias)``;
``recurrent`` says whether the state carries information between positions.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dspark_serve.ops.quantized_linear import cpu_kernel, quantize_weight


class MarkovHead(nn.Module):
    """Vanilla Markov head (Eq 5), memoryless beyond the previous token."""

    recurrent = False

    def __init__(self, vocab_size: int, rank: int, out_vocab_size: int | None = None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"a Markov head needs rank > 0, got {rank}")
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab_size or vocab_size, bias=False)
        # (compiled markov_draw, 8-bit W2) once ``compile_draw`` succeeded
        self._compiled: tuple[Callable, tuple] | None = None

    @property
    def compiled(self) -> bool:
        """Whether ``draw`` is set up (``compile_draw``)."""
        return self._compiled is not None

    def compile_draw(self) -> bool:
        """Draw whole blocks in one compiled call (``ops.cpu`` ``markov_draw``, ``draw``) with
        an 8-bit copy of W2, for inference on a CPU with the quantized-linear kernel (the
        drafter of an int4 target: ``build_drafter``). Returns False (nothing changes) without
        the kernel, off the CPU, for non-bfloat16 weights or a rank the kernel cannot take
        (a multiple of 32; W2's rows a multiple of 16)."""
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
        if (type(self) is not MarkovHead or cpu_kernel() is None or w2.device.type != "cpu"
                or w1.dtype != torch.bfloat16 or self.rank % 32 or w2.shape[0] % 16):
            return False
        self._compiled = (cpu_kernel().markov_draw,
                          quantize_weight(w2.detach(), 8).kernel_args)
        return True

    def draw(self, base_logits: torch.Tensor, anchor_tokens: torch.Tensor,
             temperature: torch.Tensor, uniforms: torch.Tensor, draft_vocab: torch.Tensor | None,
             greedy_below: float, want_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The left-to-right draw of Eq 4 with this head's bias, softmax at a temperature and
        no filters (``compile_draw`` first; the kernel's contract is in its C++ source).

        Args:
            base_logits: [R, gamma, V_d] bfloat16, U over the draft vocabulary.
            anchor_tokens: [R] int64 target ids; temperature: [R] float32 (rows below
                ``greedy_below`` take the argmax); uniforms: [R, gamma] float32 in [0, 1).
            draft_vocab: [V_d] int64 target ids of the draft vocabulary, or None (all V).
            want_probs: also return the distributions (needed when a row samples).
        Returns:
            tokens [R, gamma] int64 target ids; probs [R, gamma, V_d] float32 or None.
        Raises:
            RuntimeError: not compiled, or bad shapes or ids (from the kernel).
        """
        if self._compiled is None:
            raise RuntimeError("draw needs compile_draw() first")
        fn, w2 = self._compiled
        tokens, probs = fn(base_logits.contiguous(), self.markov_w1.weight.detach(), w2,
                           anchor_tokens.contiguous(), draft_vocab, temperature.contiguous(),
                           uniforms.contiguous(), greedy_below, want_probs)
        return tokens, probs if want_probs else None

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [...] int64 -> [..., r] (also the confidence head's Markov feature)."""
        return self.markov_w1(prev_tokens)

    def init_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        """s_0 for ``batch_shape`` rows (None: this head keeps no state)."""
        return None

    def step(self, state: torch.Tensor | None, prev_tokens: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Bias for one position: prev_tokens [...] int64, hidden [..., d] (h_k, unused here).
        Returns (state, bias [..., V or N] in the head's dtype)."""
        return state, self.markov_w2(self.prev_embedding(prev_tokens))


class GatedMarkovHead(MarkovHead):
    """Markov bias with a per-position gate on the token embedding, computed from h_k."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int,
                 out_vocab_size: int | None = None):
        super().__init__(vocab_size, rank, out_vocab_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, state: torch.Tensor | None, prev_tokens: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        emb = self.prev_embedding(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(emb.dtype), emb], dim=-1)))
        return state, self.markov_w2(gate * emb)
