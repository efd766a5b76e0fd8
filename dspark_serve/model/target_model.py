"""The target model's forward over one step's flattened tokens (Llama / Qwen2 / Qwen3 families).

transformers loads the weights, config and tokenizer; the forward is our own and lean: the
step's T tokens of all requests (prefill chunks, decode tokens, verify blocks, in any mix) go
through every layer as one [T, hidden] batch with no padding, attention reads each token's
own KV cache slot (``dspark_serve.ops.varlen_attention``: the CUDA kernel for a GPU cache
when built, its PyTorch reference otherwise), and the LM head runs only on the rows whose logits
are requested. Python work per step is a fixed number of tensor calls per layer, independent
of the number of requests; the per-step bookkeeping (attention layout, RoPE angles, cache
rows) is done once for all layers.

Usage (the engine's contract):

    model = TargetModel.from_pretrained(path, dtype="bfloat16", target_layer_ids=[1, 14, 27])
    cache = model.new_kv_cache(num_slots=16, max_len=8192, num_tokens=32768)  # a page pool
    slot = cache.allocate(len(prompt_ids))    # pages for the prompt
    cache.reserve(slot, num_tokens)           # more pages as the request grows
    out = model.forward(input_ids, slots, positions, cache, logit_indices)
    out.logits   # [N, V] float32, rows of logit_indices
    out.taps     # [T, len(target_layer_ids) * hidden] model dtype, for the drafter
    cache.free(slot)

Every position 0..p-1 of a token's slot must hold that request's committed tokens when a
token at position p is run (earlier in the same step counts). Hidden tap convention (what a
DeepSpec / DFlash drafter was trained on): tap l >= 0 is the output of decoder layer l
(0-based), before the final norm -- DeepSpec ``deepspec/modeling/target_extract.py`` hooks
``layers[l]`` (and ``embed_tokens`` for l = -1); z-lab DFlash ``extract_context_feature`` reads
transformers' ``hidden_states[l + 1]``, the same tensor for l < num_layers - 1 (transformers
replaces the last entry by the final-normed state). Tap -1 is the embedding output.

Dtype: "bfloat16" is the serving choice. Its logits are bit-identical for a token however the
step is composed (decode alone, inside a verify block, next to other requests' prefill
chunks; see ``dspark_serve.ops.paged_attention``), so greedy speculative decoding reproduces
plain decoding exactly, and its oneDNN-packed linears (``linear``) are 2x (one token) to 6x
(64 tokens) faster than float32 on an idle AVX512-BF16/AMX CPU. Its accuracy is
transformers' bfloat16's: against float32 (SmolLM2-135M, 8 chat prompts, 354 greedy
positions) top-1 agreement 98.3 % for both,
mean |logit diff| 0.128 (transformers: 0.122). "float32" matches transformers to ~1e-4 but is
not batch-invariant (MKL's float32 GEMMs change the last bits with the row count, ~2e-5 in
the logits), so speculative and plain greedy outputs can in principle part at near-ties.

Threads: on a CPU shared with other busy processes, OpenMP's default spin-waiting barriers
make multi-threaded steps 5-30x slower; set ``OMP_WAIT_POLICY=PASSIVE`` before torch is
imported (or use one thread) there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dspark_serve.model.kv_cache import PAGE_SIZE, KVCache
from dspark_serve.model.linear import QuantizedLinear, flat_call
from dspark_serve.model.target_weights import TargetWeights, load_weights
from dspark_serve.ops.paged_attention import plan_varlen, varlen_attention, varlen_kernel_applies
from dspark_serve.types import DTYPES


def fused_decoder_layer(weights: TargetWeights):
    """The compiled ``decoder_layer`` when every projection of ``weights`` is a
    ``QuantizedLinear`` sharing one kernel and the layers need nothing it lacks (no Qwen3
    q/k norms; head_dim 64 or 128, at most 16 query heads per KV head, hidden size a multiple
    of 16); else None."""
    projections = [p for layer in weights.layers
                   for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    if not projections or not all(isinstance(p, QuantizedLinear) for p in projections):
        return None
    if any(layer.qk_norm is not None for layer in weights.layers) or \
            weights.head_dim not in (64, 128) or weights.hidden_size % 16 or \
            weights.num_heads // weights.num_kv_heads > 16:
        return None
    return getattr(projections[0].kernel, "decoder_layer", None)


@dataclass
class TargetOutput:
    """Result of one step.

    logits: [N, V] float32, the next-token logits of the tokens at ``logit_indices``.
    taps:   [T, n_taps * hidden] in the model dtype, the hidden taps of every token
            (concatenated in ``target_layer_ids`` order); [T, 0] without taps.
    """

    logits: torch.Tensor
    taps: torch.Tensor


class TargetModel:
    """The target's weights plus our flat-token forward.

    Attributes:
        config: the transformers config.
        weights: ``TargetWeights`` (fused QKV and gate/up projections).
        target_layer_ids: layers whose outputs ``forward`` returns as taps (-1 = embedding).
        embed_tokens: int64 [...] -> [..., hidden] (shared with the drafter).
        lm_head: [..., hidden] -> [..., V] with a ``weight`` (shared with the drafter).
    """

    def __init__(self, weights: TargetWeights, config, target_layer_ids: Sequence[int] = ()):
        self.config = config
        self.weights = weights
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self._tapped = frozenset(self.target_layer_ids)
        n = weights.num_layers
        bad = [i for i in self.target_layer_ids if not -1 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids must be in [-1, {n - 1}], got {bad}")
        self.embed_tokens = nn.Embedding.from_pretrained(weights.embed, freeze=True)
        self.lm_head = nn.Linear(weights.hidden_size, weights.vocab_size, bias=False,
                                 device="meta")
        self.lm_head.weight = nn.Parameter(weights.lm_head, requires_grad=False)
        # Quantized (int4) layers on a CPU with our kernel run each decoder layer as one
        # compiled call: the same arithmetic as the Python loop's projections, with norms,
        # RoPE, attention and SiLU in float32 in between, and none of the loop's ~50 small
        # torch calls per layer (SmolLM2-135M, one thread, AMD EPYC: a one-token step
        # 23.6 -> ~7 ms).
        self._fused = fused_decoder_layer(weights)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu",
                        target_layer_ids: Sequence[int] = (),
                        quantization: str = "none") -> "TargetModel":
        """Load an HF folder of the Llama / Qwen2 / Qwen3 family (``quantization``: see
        ``target_weights.load_weights``).

        Raises:
            ValueError: unsupported architecture or features (sliding windows, a RoPE type
                whose frequencies depend on the sequence length), unknown dtype or
                quantization.
        """
        from transformers import AutoModelForCausalLM

        torch_dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if torch_dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        return cls.from_hf(hf, device=device, target_layer_ids=target_layer_ids,
                           quantization=quantization)

    @classmethod
    def from_hf(cls, hf_model, *, device: str | torch.device | None = None,
                target_layer_ids: Sequence[int] = (),
                quantization: str = "none") -> "TargetModel":
        """Take the weights of a loaded transformers causal LM (in its dtype); the HF module
        itself is not kept."""
        return cls(load_weights(hf_model, device, quantization), hf_model.config,
                   target_layer_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    def new_kv_cache(self, num_slots: int, max_len: int,
                     num_tokens: int | None = None) -> KVCache:
        """An empty cache of ``num_slots`` request slots of up to ``max_len`` positions each:
        a pool of ``num_tokens`` positions (rounded up to whole ``PAGE_SIZE`` pages) shared by
        the slots, or None = one page of ``max_len`` positions per slot."""
        w = self.weights
        pool = {} if num_tokens is None else dict(page_size=PAGE_SIZE,
                                                  num_pages=-(-num_tokens // PAGE_SIZE))
        return KVCache(w.num_layers, num_slots, max_len, w.num_kv_heads, w.head_dim,
                       self.dtype, self.device, **pool)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, logit_indices: torch.Tensor | None = None) -> TargetOutput:
        """Run one step over T flattened tokens, writing their keys/values to the cache.

        Args:
            input_ids, slots, positions: [T] int64 (T >= 1) token ids, KV cache slots
                (allocated), absolute positions (< cache.max_len, reserved for their slot).
            cache: from ``new_kv_cache``.
            logit_indices: [N] int64 token indices (into 0..T-1) whose logits to compute;
                None = all T tokens.
        Returns:
            ``TargetOutput`` (logits [N, V] float32, taps [T, n_taps * hidden]); both are
            inference-mode tensors (``clone()`` them outside inference mode before using them
            in autograd).
        Raises:
            ValueError: bad shapes/dtypes, unallocated slots, positions out of range,
                token ids outside the vocabulary, logit indices outside 0..T-1.
        """
        w = self.weights
        cache.check_tokens(slots, positions)
        t = slots.numel()
        if input_ids.shape != (t,) or input_ids.dtype != torch.int64 or t == 0:
            raise ValueError(f"input_ids must be int64 [T] with T = len(slots) >= 1, got "
                             f"{input_ids.dtype} {tuple(input_ids.shape)}")
        if bool(((input_ids < 0) | (input_ids >= w.vocab_size)).any()):
            raise ValueError(f"token ids must be in [0, {w.vocab_size})")
        if logit_indices is not None and logit_indices.numel() and bool(
                ((logit_indices < 0) | (logit_indices >= t)).any()):
            raise ValueError(f"logit_indices must be in [0, {t})")
        h = F.embedding(input_ids, w.embed)
        outputs = {-1: h} if -1 in self._tapped else {}   # tapped layer -> its output
        layers = self._fused_layers if self._fused is not None else self._layers
        h = layers(h, slots, positions, cache, outputs)
        # one concatenation at the end, not a copy into a buffer per tapped layer
        taps = (torch.cat([outputs[i] for i in self.target_layer_ids], dim=1)
                if self.target_layer_ids else h.new_empty(t, 0))
        if logit_indices is not None:
            h = h.index_select(0, logit_indices)
        h = F.rms_norm(h, (w.hidden_size,), w.final_norm, w.eps)
        return TargetOutput(logits=w.head(h).float(), taps=taps)

    __call__ = forward

    def _layers(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, outputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """The decoder layers over h [T, hidden] (any dtype and projection kind); the outputs
        of tapped layers go into ``outputs``."""
        w = self.weights
        t = h.shape[0]
        hq, hkv, d = w.num_heads, w.num_kv_heads, w.head_dim
        marker = torch.stack([slots, positions], dim=1)
        k_pages, v_pages = cache.paged(0)
        # The CUDA kernel (when built) needs no plan; the reference shares one across layers.
        plan = None
        if not varlen_kernel_applies(k_pages.new_empty((0, hq, d)), k_pages, v_pages):
            plan = plan_varlen(marker, hq // hkv, k_pages, cache.page_table)
        rows = cache.write_rows(slots, positions)
        cos, sin = w.rope(positions)
        for i, layer in enumerate(w.layers):
            x = F.rms_norm(h, (w.hidden_size,), layer.input_norm, w.eps)
            qkv = layer.qkv(x)
            qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (d,), None, w.eps) * layer.qk_norm
            # Rotating the query and key heads together: one RoPE call per layer.
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
            k, v = qk[:, hq:], qkv[:, (hq + hkv) * d:].view(t, hkv, d)
            cache.write(i, rows, k, v)
            o = varlen_attention(qk[:, :hq], marker, *cache.paged(i), cache.page_table,
                                 scale=w.scale, validate=False, plan=plan)
            h = h + layer.o_proj(o.reshape(t, hq * d))
            x = F.rms_norm(h, (w.hidden_size,), layer.post_norm, w.eps)
            gate_up = layer.gate_up(x)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
            if i in self._tapped:
                outputs[i] = h
        return h

    def _fused_layers(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                      cache: KVCache, outputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """The decoder layers as one compiled call each (``ops.cpu`` ``decoder_layer``: the
        int4 fast path, see ``__init__``)."""
        w = self.weights
        cos, sin = w.rope_angles(positions)
        table = cache.page_table.long().contiguous()
        slots, positions = slots.contiguous(), positions.contiguous()   # e.g. expanded views
        for i, layer in enumerate(w.layers):
            h = self._fused(h, layer.input_norm, layer.post_norm, w.eps,
                            layer.qkv.quantized.kernel_args, layer.qkv.bias,
                            layer.o_proj.quantized.kernel_args, layer.o_proj.bias,
                            layer.gate_up.quantized.kernel_args, layer.gate_up.bias,
                            layer.down.quantized.kernel_args, layer.down.bias,
                            cos, sin, cache.k[i], cache.v[i], table, slots, positions,
                            w.num_heads, w.num_kv_heads, w.scale)
            if i in self._tapped:
                outputs[i] = h
        return h

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on the serving path: hidden [..., H] in the model dtype -> logits
        [..., V] in the model dtype, through the (packed) ``weights.head``. Inference only (no
        gradient); ``lm_head`` is the autograd-friendly module training uses."""
        return flat_call(self.weights.head, hidden)
