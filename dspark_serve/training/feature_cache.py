"""On-disk cache of the frozen target's per-token features for drafter training.

One target prefill per sequence gives everything a training step needs from the target, for
every token at once, so training never runs the target again (paper Section 3.3; issue 15):

- the hidden taps at the drafter's ``target_layer_ids`` (the context of Eq 2), and
- the final hidden state f_t (after the final norm, the LM head's input), from which the
  target's next-token logits f_t W^T on any subset of vocabulary rows are recomputed at train
  time; the full-vocabulary log-normaliser ``lse_t = logsumexp_v f_t . W_v`` and the greedy
  token ``argmax_v f_t . W_v`` are stored beside it, so probabilities on a pruned draft
  vocabulary p_t(v) = exp(f_t . W_v - lse_t) and the mass outside it come out right.

Both come from the bf16-stored f_t: the greedy token and the 64 largest logits in float32, as
``target_logits_rows`` computes them at train time, the tail of the logsumexp from a bf16
product (``head_lse_greedy``).

Layout of a cache folder: ``shard-NNNNN.bin`` (raw bf16 [T, C + H]: taps then f_t, memory
mapped), ``shard-NNNNN.pt`` (ids/loss_mask/lse/greedy per token, sequence offsets and keys),
written after the .bin and renamed into place, so a shard exists only when complete, and
``meta.json`` (shape and the target's tap layers). Bytes per token: (n_taps + 1) * H * 2
(6,912 for SmolLM2-135M with 5 taps) plus 13 of metadata.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dspark_serve.model.target_model import TargetModel

META_FILE = "meta.json"
_SHARD = re.compile(r"^shard-(\d+)\.pt$")
# rows per chunk when computing lse/argmax (bounds the temporary logits)
_HEAD_CHUNK = 256
# logits per row recomputed in float32 after the bf16 product
_EXACT_TOP = 64


@dataclass
class CachedSequence:
    """One cached sequence of T tokens.

    ids: [T] int64 tokens; loss_mask: [T] bool (True on supervised, i.e. response, tokens);
    taps: [T, C] bf16 target taps (C = n_taps * H); final: [T, H] bf16 final hidden f_t;
    lse: [T] float32 full-vocabulary logsumexp of the target logits at t (predicting t + 1);
    greedy: [T] int64 the target's argmax token at t (its greedy next token).
    taps/final are views of a read-only memory map: do not write to them.
    """

    key: str
    ids: torch.Tensor
    loss_mask: torch.Tensor
    taps: torch.Tensor
    final: torch.Tensor
    lse: torch.Tensor
    greedy: torch.Tensor

    def to(self, device: str | torch.device) -> "CachedSequence":
        """This sequence with every tensor on ``device`` (itself when already there)."""
        if self.taps.device == torch.device(device):
            return self
        return CachedSequence(self.key, *(getattr(self, f).to(device) for f in
                                          ("ids", "loss_mask", "taps", "final", "lse", "greedy")))


def target_logits_rows(final: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """Target logits on chosen vocabulary rows, f_t . W_v, in float32.

    Args:
        final: [..., H] final hidden states (any float dtype, typically bf16 from the cache).
        head_rows: [N, H] LM-head rows (float32, or cast to it).
    Returns:
        [..., N] float32.
    """
    return F.linear(final.float(), head_rows.float())


@torch.no_grad()
def head_lse_greedy(final: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary logsumexp and argmax of f_t W^T, in row chunks.

    The full product runs in bf16 (3x the float32 rate on CPU; it was ~30% of a cache
    build), then the ``_EXACT_TOP`` largest logits of each row are recomputed in float32, so
    the argmax and the dominant terms of the logsumexp are the float32 ones of
    ``target_logits_rows``; only the small tail carries bf16 rounding (relative 2^-8 of each
    tail logit, so the lse error is at most that times the tail's share of the mass).

    Args:
        final: [T, H] final hidden states; head: [V, H] LM-head weight.
    Returns:
        lse [T] float32, greedy [T] int64.
    """
    w16 = head.to(torch.bfloat16)
    lse, greedy = [], []
    for chunk in final.split(_HEAD_CHUNK):
        approx = F.linear(chunk.to(torch.bfloat16), w16).float()
        top = approx.topk(min(_EXACT_TOP, approx.shape[1]), dim=-1).indices   # [n, K]
        exact = torch.einsum("nh,nkh->nk", chunk.float(), head[top].float())
        approx.scatter_(1, top, exact)
        lse.append(torch.logsumexp(approx, dim=-1))
        greedy.append(top.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1))
    return torch.cat(lse), torch.cat(greedy)


@torch.no_grad()
def target_token_features(target: TargetModel,
                          sequences: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """One flat prefill of the frozen target over S sequences.

    Args:
        target: a ``TargetModel`` loaded with the drafter's taps plus its last layer as the final
            tap (``target_layer_ids = drafter taps + [num_layers - 1]``).
        sequences: S tensors [T_s] int64.
    Returns:
        per sequence (taps [T_s, C] bf16, final [T_s, H] bf16, lse [T_s] float32,
        greedy [T_s] int64), C = (len(target_layer_ids) - 1) * H.
    Raises:
        ValueError: the target's last tap is not its last layer.
    """
    w = target.weights
    if not target.target_layer_ids or target.target_layer_ids[-1] != w.num_layers - 1:
        raise ValueError("load the target with its last layer as the final tap "
                         f"(target_layer_ids ending in {w.num_layers - 1})")
    lengths = [int(s.numel()) for s in sequences]
    cache = target.new_kv_cache(len(sequences), max(lengths))
    slots = torch.tensor([cache.allocate() for _ in sequences], dtype=torch.int64)
    ids = torch.cat(sequences).to(target.device)
    flat_slots = slots.repeat_interleave(torch.tensor(lengths)).to(target.device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(target.device)
    out = target.forward(ids, flat_slots, positions, cache,
                         torch.zeros(1, dtype=torch.int64, device=target.device))
    hidden = w.hidden_size
    last = out.taps[:, -hidden:]
    # the final norm exactly as TargetModel.forward applies it before the LM head
    final = F.rms_norm(last, (hidden,), w.final_norm, w.eps).to(torch.bfloat16)
    taps = out.taps[:, :-hidden].to(torch.bfloat16)
    lse, greedy = head_lse_greedy(final, target.lm_head.weight)
    result, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        result.append((taps[sl].clone(), final[sl].clone(), lse[sl].clone(), greedy[sl].clone()))
        start += n
    return result


class FeatureCache:
    """Read side of a cache folder: every complete shard, memory-mapped.

    Raises:
        FileNotFoundError: no ``meta.json`` (not a cache folder).
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta_path = self.folder / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} not found: run `dspark-serve cache-features`")
        self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        self.hidden = int(self.meta["hidden_size"])
        self.tap_width = int(self.meta["num_taps"]) * self.hidden
        self._rows: list[tuple[int, int, int, int]] = []   # (shard, row in shard, start, T)
        self._shards: list[dict] = []
        self._maps: dict[int, torch.Tensor] = {}
        for index, path in shard_paths(self.folder):
            info = torch.load(path, weights_only=True)
            self._shards.append(info)
            offsets = info["offsets"].tolist()
            for j in range(len(offsets) - 1):
                self._rows.append((len(self._shards) - 1, j, offsets[j],
                                   offsets[j + 1] - offsets[j]))

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def keys(self) -> set[str]:
        """Keys of every cached sequence (what a resumed ``build`` skips)."""
        return {k for info in self._shards for k in info["keys"]}

    @property
    def num_tokens(self) -> int:
        return sum(n for *_, n in self._rows)

    def lengths(self) -> list[int]:
        """T of every sequence, in cache order."""
        return [n for *_, n in self._rows]

    def _map(self, shard: int) -> torch.Tensor:
        if shard not in self._maps:
            info = self._shards[shard]
            width = self.tap_width + self.hidden
            arr = np.memmap(self.folder / info["bin"], dtype=np.uint16, mode="r",
                            shape=(int(info["offsets"][-1]), width))
            # bf16 has no numpy dtype: map the bits as uint16 and reinterpret them; the map is
            # read-only by design (CachedSequence says so), hence the silenced warning
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._maps[shard] = torch.from_numpy(arr).view(torch.bfloat16)
        return self._maps[shard]

    def __getitem__(self, i: int) -> CachedSequence:
        shard, row, start, n = self._rows[i]
        info = self._shards[shard]
        sl = slice(start, start + n)
        feats = self._map(shard)[sl]
        return CachedSequence(key=info["keys"][row], ids=info["ids"][sl].long(), loss_mask=info["loss_mask"][sl],
                              taps=feats[:, :self.tap_width], final=feats[:, self.tap_width:],
                              lse=info["lse"][sl], greedy=info["greedy"][sl].long())


def shard_paths(folder: Path) -> list[tuple[int, Path]]:
    """Complete shards of a cache folder in index order: [(index, path of the .pt)]."""
    found = [(int(m.group(1)), p) for p in folder.glob("shard-*.pt") if (m := _SHARD.match(p.name))]
    return sorted(found)


def write_meta(folder: Path, *, hidden_size: int, target_layer_ids: list[int],
               model: str) -> None:
    """Create ``meta.json`` or check an existing one matches (ValueError otherwise)."""
    meta = {"hidden_size": hidden_size, "num_taps": len(target_layer_ids),
            "target_layer_ids": list(target_layer_ids), "model": model, "dtype": "bfloat16"}
    path = folder / META_FILE
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        if {k: old.get(k) for k in meta} != meta:
            raise ValueError(f"{path} was built for {old}, not {meta}: use a new folder")
        return
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1), encoding="utf-8")


def write_shard(folder: Path, index: int, records: list[tuple[str, torch.Tensor, torch.Tensor,
                                                               tuple[torch.Tensor, ...]]]) -> Path:
    """Write one shard atomically: the .bin first, then the .pt by rename (its presence marks
    the shard complete).

    Args:
        records: (key, ids [T] int64, loss_mask [T] bool, features from
            ``target_token_features``) per sequence.
    Returns:
        the .pt path.
    """
    name = f"shard-{index:05d}"
    feats = torch.cat([torch.cat([f[0], f[1]], dim=1) for *_, f in records])
    with open(folder / f"{name}.bin", "wb") as fh:
        fh.write(feats.contiguous().view(torch.uint16).numpy().tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    lengths = [int(ids.numel()) for _, ids, _, _ in records]
    info = {"bin": f"{name}.bin", "keys": [k for k, *_ in records],
            "offsets": torch.tensor([0] + lengths).cumsum(0),
            "ids": torch.cat([ids for _, ids, _, _ in records]).to(torch.int32),
            "loss_mask": torch.cat([m for _, _, m, _ in records]),
            "lse": torch.cat([f[2] for *_, f in records]),
            "greedy": torch.cat([f[3] for *_, f in records]).to(torch.int32)}
    tmp = folder / f".{name}.pt.tmp"
    torch.save(info, tmp)
    os.replace(tmp, folder / f"{name}.pt")
    return folder / f"{name}.pt"
