"""``DSparkDrafter``: DFlash backbone + sequential head + confidence head, drafting for many
request slots at once, on top of the target's frozen embedding and LM head (paper Section 3.1).

Engine protocol, per request slot s (positions are absolute token positions):

1. After prefill of a P-token prompt, ``extend_context(cache, s, 0..P-1, taps)`` with the
   target's hidden taps of the prompt; the first sampled token is the anchor, at position P.
2. Each round, ``draft(cache, slots, anchors, anchor_positions, ...)`` drafts gamma tokens
   x_1..x_gamma for positions anchor_pos+1..anchor_pos+gamma. The block sees the context
   positions < anchor_pos, so every position before the anchor must have been added.
3. After verification commits the anchor and the accepted drafts (positions
   anchor_pos..anchor_pos+tau-1), ``extend_context`` with the target taps the verify pass
   computed for them; the recovered/bonus token becomes the next anchor. Only new positions
   are projected; rejected drafts never enter the cache.

Shape symbols: R requests in the round, N context tokens added, gamma draft tokens, V vocab,
V_d the draft vocabulary (V, or ``draft_vocab_size`` when pruned: ``draft_vocab``), d hidden
size, C = len(target_layer_ids) * d (the concatenated target taps).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from dspark_serve.drafter.backbone import DFlashBackbone
from dspark_serve.drafter.block_sampler import sample_block, teacher_forced
from dspark_serve.drafter.confidence_head import ConfidenceHead
from dspark_serve.drafter.config import DSparkConfig
from dspark_serve.drafter.context_cache import DraftContextCache
from dspark_serve.drafter.draft_vocab import ids_from_d2t
from dspark_serve.drafter.markov_head import GatedMarkovHead, MarkovHead
from dspark_serve.drafter.rnn_head import RNNHead
from dspark_serve.types import DraftBlock, SamplingTensors


def build_sequential_head(cfg: DSparkConfig) -> MarkovHead | None:
    """The configured sequential head; None for markov_rank 0 (the DFlash ablation)."""
    if cfg.markov_rank == 0:
        return None
    if cfg.markov_head_type == "vanilla":
        return MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.draft_vocab_size)
    cls = GatedMarkovHead if cfg.markov_head_type == "gated" else RNNHead
    return cls(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size, cfg.draft_vocab_size)


class DSparkDrafter(nn.Module):
    """The drafter. Its parameters (``state_dict``) are the backbone (under ``backbone.``),
    ``markov_head.*``, ``confidence_head.*`` and, with a pruned draft vocabulary, the buffer
    ``d2t`` [V_d] int64 (EAGLE-3 offsets, ``dspark_serve.drafter.draft_vocab``); the target's
    embedding and LM head are held by reference, never registered, moved or saved.

    Args:
        config: ``DSparkConfig``.
        embed_tokens: the target's token embedding, int64 [...] -> [..., d].
        lm_head: the draft LM head, [..., d] -> [..., V_d]: the target's head, or for a pruned
            vocabulary its rows at ``draft_vocab`` (``draft_vocab.pruned_lm_head``, which the
            checkpoint loader builds); if it has a ``weight``, hidden states are cast to that
            dtype first.
    """

    def __init__(self, config: DSparkConfig, embed_tokens: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.config = config
        self.backbone = DFlashBackbone(config)
        self.markov_head = build_sequential_head(config)
        self.confidence_head = (ConfidenceHead(config.hidden_size, config.markov_rank
                                               if config.confidence_head_with_markov else 0)
                                if config.enable_confidence_head else None)
        # A tuple keeps nn.Module from registering the target's modules as our children.
        self._shared = (embed_tokens, lm_head)
        if config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """[V_d] int64 ascending target ids of a pruned draft vocabulary; None = all V."""
        return None if self.d2t is None else ids_from_d2t(self.d2t)

    @property
    def shared_modules(self) -> tuple[Callable, Callable]:
        """(embed_tokens, lm_head) of the target, as passed in."""
        return self._shared

    @property
    def gamma(self) -> int:
        """Draft tokens per round."""
        return self.config.gamma

    def new_cache(self, num_slots: int, max_len: int,
                  device: torch.device | str | None = None) -> DraftContextCache:
        """An empty context cache for ``num_slots`` slots of up to ``max_len`` context
        positions (paged: its memory follows the context held), in the drafter's dtype, on
        its device unless ``device`` is given."""
        w, cfg = self.backbone.fc.weight, self.config
        return DraftContextCache(cfg.num_hidden_layers, num_slots, max_len,
                                 cfg.num_key_value_heads, cfg.head_dim, w.dtype,
                                 w.device if device is None else device,
                                 state_dim=cfg.hidden_size if cfg.anchor_context else None)

    @torch.no_grad()
    def extend_context(self, cache: DraftContextCache, slots: torch.Tensor,
                       positions: torch.Tensor, target_hidden: torch.Tensor) -> None:
        """Project N newly committed tokens into every layer's context K/V and store them.

        Args:
            cache: from ``new_cache``.
            slots: [N] int64 slot of each token (several tokens per slot allowed).
            positions: [N] int64 absolute positions; per slot they must continue the cached
                context without gaps (rewriting cached positions is allowed).
            target_hidden: [N, C] the target's hidden taps at those tokens.
        Raises:
            ValueError: bad shapes, slots or positions.
        """
        cache.check_slots(slots)
        compiled = self.backbone.compiled_context(target_hidden, positions)
        if compiled is not None:
            h_ctx, k, v = compiled
        else:
            h_ctx = self.backbone.context_state(target_hidden)
            k, v = self.backbone.context_kv(h_ctx, positions)
        cache.write(slots, positions, k, v, h_ctx if self.config.anchor_context else None)

    def block_forward(self, cache: DraftContextCache, slots: torch.Tensor,
                      anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                      num_drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel stage for R blocks: hidden states and base logits of the draft
        positions (block slots label_offset..block_size-1).

        Args:
            slots, anchor_tokens, anchor_positions: [R] int64; anchor_positions[r] <= the
                cached context length of slots[r].
            num_drafts: g, the first g draft positions only (1..gamma; None = gamma): the
                block is cut to its first label_offset + g slots, so fewer rows go through
                the layers, the LM head and the draw. The kept slots' outputs differ from
                the full block's (they attend to fewer mask slots); exact either way, since
                verification uses the distributions drawn.
        Returns:
            hidden [R, g, d] (drafter dtype), base_logits [R, g, V_d] (LM-head dtype).
        Raises:
            ValueError: bad shapes, num_drafts out of range or an anchor past its slot's
                cached context.
        """
        cache.check_slots(slots)
        r, cfg = slots.shape[0], self.config
        if num_drafts is not None and not 1 <= num_drafts <= cfg.gamma:
            raise ValueError(f"num_drafts must be in 1..{cfg.gamma}, got {num_drafts}")
        for name, t in (("anchor_tokens", anchor_tokens), ("anchor_positions", anchor_positions)):
            if t.shape != (r,) or t.dtype != torch.int64 or t.device != slots.device:
                raise ValueError(f"{name} must be int64 [{r}] on {slots.device}, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if r and bool(((anchor_positions < 0) | (anchor_positions > cache.lengths[slots])).any()):
            raise ValueError("every anchor position must be in [0, cached context length]: "
                             "all positions before the anchor need their context")
        size = cfg.block_size if num_drafts is None else cfg.label_offset + num_drafts
        offsets = torch.arange(size, device=slots.device)
        block_ids = torch.where(offsets == 0, anchor_tokens[:, None], cfg.mask_token_id)
        embed_tokens, lm_head = self.shared_modules
        block_embeds = embed_tokens(block_ids)
        if cfg.anchor_context:
            block_embeds = self.backbone.with_anchor_state(
                block_embeds, cache.states(slots, anchor_positions - 1))
        block_positions = anchor_positions[:, None] + offsets
        if self.backbone.compiled and r:
            hidden = self.backbone.compiled_forward(block_embeds, block_positions, cache, slots,
                                                    anchor_positions)
        else:
            ctx_len = int(anchor_positions.max()) if r else 0
            ctx_mask = torch.arange(ctx_len, device=slots.device) < anchor_positions[:, None]
            hidden = self.backbone(block_embeds, block_positions,
                                   lambda i: cache.context(i, slots, ctx_len), ctx_mask)
        hidden = hidden[:, cfg.label_offset:]
        weight = getattr(lm_head, "weight", None)
        return hidden, lm_head(hidden if weight is None else hidden.to(weight.dtype))

    @torch.no_grad()
    def draft(self, cache: DraftContextCache, slots: torch.Tensor, anchor_tokens: torch.Tensor,
              anchor_positions: torch.Tensor, sampling: SamplingTensors,
              uniforms: torch.Tensor) -> DraftBlock:
        """One drafting round for R slots (Eq 2-7): backbone pass, left-to-right sampling
        with the sequential head, confidence logits.

        Args:
            slots, anchor_tokens, anchor_positions: [R] int64 (see ``block_forward``).
            sampling: ``SamplingTensors`` with R rows (same warping as the verifier).
            uniforms: [R, g] float32 in [0, 1), one per draft position: g = gamma drafts a
                full block, g < gamma its first g positions only (``block_forward``'s
                num_drafts).
        Returns:
            ``DraftBlock``: tokens [R, g] int64 target ids, probs [R, g, V] float32
            (exactly 0 outside a pruned draft vocabulary), conf_logits [R, g] float32
            (zeros without a confidence head).
        Raises:
            ValueError: bad shapes (uniforms wider than gamma included).
        """
        if uniforms.dim() != 2:
            raise ValueError(f"uniforms must be [R, g], got {tuple(uniforms.shape)}")
        hidden, base_logits = self.block_forward(cache, slots, anchor_tokens, anchor_positions,
                                                 uniforms.shape[1])
        return sample_block(base_logits, hidden, anchor_tokens, self.markov_head,
                            self.confidence_head, sampling, uniforms,
                            draft_vocab=self.draft_vocab, vocab_size=self.config.vocab_size)

    def teacher_forced(self, cache: DraftContextCache, slots: torch.Tensor,
                       anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                       tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq 4 logits [R, gamma, V_d] float32 (over the draft vocabulary) and confidence
        logits [R, gamma] float32 of given draft tokens [R, gamma] int64 (target ids), in one
        backbone pass. Gradients reach the block
        path and the heads but not the cached context K/V (``extend_context`` runs without
        grad); training passes its own context to ``DFlashBackbone.forward`` built with
        ``DFlashBackbone.context_kv`` and then calls ``block_sampler.teacher_forced``."""
        hidden, base_logits = self.block_forward(cache, slots, anchor_tokens, anchor_positions)
        return teacher_forced(base_logits, hidden, anchor_tokens, tokens, self.markov_head,
                              self.confidence_head)
