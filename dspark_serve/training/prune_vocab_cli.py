"""``dspark-serve prune-vocab``: cut a drafter's output vocabulary to the N target tokens most
frequent in ShareGPT's assistant answers (FR-Spec / EAGLE-3 style; ``drafter.draft_vocab``).

Ranked on a large answer corpus, not on the target's own outputs (issue 15: ranking by ~70k
target tokens covers 83 % of held-out outputs at N = 16k; ShareGPT's answers cover 96 %).
MT-Bench, HumanEval and AlpacaEval are never read.
"""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("prune-vocab", help="prune a drafter's draft vocabulary",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--draft", required=True, help="drafter folder (DeepSpec format)")
    p.add_argument("--out", required=True, help="output drafter folder")
    p.add_argument("--size", type=int, default=16384, help="draft vocabulary size N")
    p.add_argument("--model", default=None, help="target HF folder (its tokenizer ranks the "
                                                 "corpus; default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus-limit", type=int, default=None,
                   help="ShareGPT answers read (default: all)")
    p.add_argument("--ranking-only", action="store_true",
                   help="write only the token ranking into --out (the engine prunes the draft "
                        "vocabulary at load: serve --draft-vocab-size)")
    p.add_argument("--expand", action="store_true",
                   help="the inverse: write the pruned --draft with the full vocabulary into "
                        "--out (zero Markov rows outside; the engine prunes it back exactly "
                        "with the folder's token ranking)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.expand:
        from dspark_serve.drafter.checkpoint import expand_draft_vocab

        config = expand_draft_vocab(args.draft, args.out)
        print(f"dspark-serve prune-vocab --expand: {config.vocab_size} tokens -> {args.out}")
        return 0
    from transformers import AutoTokenizer

    from dspark_serve.data.prompt_sets import load_records
    from dspark_serve.drafter.checkpoint import prune_draft_vocab, read_config
    from dspark_serve.drafter.draft_vocab import save_ranking, token_ranking, top_tokens
    from dspark_serve.assets.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(args.model or default_model_path())
    answers = [r.reference for r in load_records("sharegpt", args.corpus_limit) if r.reference]
    streams = tokenizer(answers, add_special_tokens=False)["input_ids"]
    vocab = read_config(args.draft).vocab_size
    ranking = token_ranking(streams, vocab)
    tokens = sum(len(s) for s in streams)
    if args.ranking_only:
        path = save_ranking(args.out, ranking)
        print(f"dspark-serve prune-vocab: ranking of {vocab} tokens from {len(answers)} answers "
              f"({tokens} tokens) -> {path}")
        return 0
    prune_draft_vocab(args.draft, args.out, top_tokens(ranking, args.size))
    print(f"dspark-serve prune-vocab: {args.size} of {vocab} tokens from {len(answers)} answers "
          f"({tokens} tokens) -> {args.out}")
    return 0
