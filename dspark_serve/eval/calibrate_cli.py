"""``dspark-serve calibrate``: fit STS temperatures (paper Section 3.2.1) for a trained drafter,
or (``--kind ngram``) the prompt-lookup survival table (``calibration.lookup``).

DSpark: runs drafter + target rounds on held-out ShareGPT prompts (the ``heldout`` list of a
``gen-data`` folder, never trained on) at the serving temperature with full-gamma verification
(static), labels each round with its real rejection-sampling outcome (prefix survival), fits
the per-position temperatures and writes ``sts_calibration.json`` beside the drafter (the
engine loads it automatically) plus a reliability diagram PNG (raw vs STS).

Prompt lookup: the target answers ShareGPT prompts greedily (from the end of the set, which
``gen-data`` splits and ``dspark-serve corpus`` never reach), lookup rounds are replayed on
those outputs (``eval.lookup_rounds``: exact at temperature 0) and the table is written to the
target's shipped ``ngram/lookup_calibration.json`` (or ``--out``). Corpus lookup
(``--kind corpus``): the same with corpus rounds, the table keyed by support key, written
into the corpus folder (or ``--out``).
"""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="fit STS calibration on held-out prompts",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kind", choices=("dspark", "ngram", "corpus"), default="dspark",
                   help="what to calibrate: the drafter's STS, prompt lookup or corpus lookup")
    p.add_argument("--corpus", default=None,
                   help="corpus folder (corpus; default: the target's shipped corpus); the "
                        "table is written into it unless --out")
    p.add_argument("--draft", default=None, help="trained DSpark drafter folder (dspark)")
    p.add_argument("--data", default=None, help="gen-data folder (its held-out prompts; dspark)")
    p.add_argument("--model", default=None,
                   help="target HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=200, help="held-out prompts used")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="longer held-out prompts are skipped (as gen-data does; dspark)")
    p.add_argument("--temperature", type=float, default=1.0, help="serving sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="serving top-p")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--out", default=None,
                   help="calibration JSON (default: DRAFT/sts_calibration.json)")
    p.add_argument("--png", default=None,
                   help="reliability diagram (default: DRAFT/reliability.png)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the drafter's draft vocabulary as `serve --draft-vocab-size` prunes it "
                        "(default: as served)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def heldout_prompts(data: str, limit: int | None) -> list[str]:
    """The first ``limit`` (None: all) held-out ShareGPT prompts of a gen-data folder.
    Raises ValueError if the prompt set no longer reproduces the folder's split."""
    from dspark_serve.data.prompt_sets import load_prompts
    from dspark_serve.training.dataset import read_split
    from dspark_serve.training.gen_data import split_prompts

    manifest = read_split(data)
    unique, again = split_prompts(load_prompts("sharegpt"), manifest["num_prompts"],
                                  len(manifest["heldout"]), manifest["seed"])
    if again["heldout"] != manifest["heldout"]:
        raise ValueError(f"the ShareGPT prompts no longer reproduce the split of {data}")
    return [unique[i] for i in manifest["heldout"][:limit]]


def run(args: argparse.Namespace) -> int:
    if args.kind in ("ngram", "corpus"):
        return run_lookup(args)
    if not args.draft or not args.data:
        raise SystemExit("dspark-serve calibrate: --draft and --data are required for dspark")
    import torch

    from dspark_serve.calibration import (fit_calibration, prefix_survival_labels,
                                          save_sts_calibration)
    from dspark_serve.calibration.metrics import reliability_diagram
    from dspark_serve.calibration.sts import calibrated_confidence
    from dspark_serve.eval.loading import chat_prompts, load_pair
    from dspark_serve.eval.rounds import run_rounds

    pair = load_pair(args.model, args.draft, "dspark", args.dtype, args.draft_vocab_size)
    if pair.drafter.confidence_head is None:
        raise ValueError(f"{args.draft} has no confidence head: nothing to calibrate")
    # ShareGPT has prompts past the target's context (9,150 tokens among the first 160)
    prompts = [p for p in chat_prompts(pair.tokenizer, heldout_prompts(args.data, None))
               if len(p) <= args.max_prompt_tokens][:args.num_prompts]
    if not prompts:
        raise ValueError(f"no held-out prompt of {args.data} fits --max-prompt-tokens "
                         f"{args.max_prompt_tokens}")
    rounds = run_rounds(pair.target, pair.drafter, prompts, temperature=args.temperature,
                        top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, eos_ids=pair.eos_ids, seed=args.seed,
                        progress=True)
    g = rounds.gamma
    survived, valid = prefix_survival_labels(rounds.num_accepted,
                                             torch.full_like(rounds.num_accepted, g), g)
    cal = fit_calibration(rounds.conf_logits, survived, valid=valid,
                          dataset=f"sharegpt-heldout prompts={len(prompts)} "
                                  f"temperature={args.temperature:g} top_p={args.top_p:g}")
    out = Path(args.out or Path(pair.draft_path) / "sts_calibration.json")
    save_sts_calibration(out, cal)
    z = rounds.conf_logits.double()
    before = torch.cumprod(torch.sigmoid(z), 1)
    after = torch.cumprod(calibrated_confidence(z, torch.tensor(cal.temperatures).double()), 1)
    png = reliability_diagram(args.png or Path(pair.draft_path) / "reliability.png", before,
                              survived, survival_after=after, valid=valid,
                              title=f"STS on {len(prompts)} held-out ShareGPT prompts, "
                                    f"T={args.temperature:g}")
    mean = lambda xs: sum(xs) / len(xs)
    print(f"rounds {cal.num_samples}, temperatures {[round(t, 3) for t in cal.temperatures]}")
    print(f"mean ECE {100 * mean(cal.ece_before):.2f}% -> {100 * mean(cal.ece_after):.2f}%")
    print(f"wrote {out} and {png}")
    return 0


def run_lookup(args: argparse.Namespace) -> int:
    """``--kind ngram`` / ``--kind corpus``: fit and write the prompt-lookup or corpus-lookup
    survival table."""
    import numpy as np

    from dspark_serve.assets.default_drafter import LOOKUP_GAMMA, SHIPPED_DIR, shipped_corpus
    from dspark_serve.calibration.lookup import FILE_NAME, fit_lookup_calibration
    from dspark_serve.data.prompt_sets import load_prompts
    from dspark_serve.drafter.corpus_lookup import FILE_NAME as CORPUS_FILE
    from dspark_serve.drafter.corpus_lookup import CorpusIndex, load_corpus, num_keys
    from dspark_serve.engine.config import EngineConfig
    from dspark_serve.engine.llm_engine import LLMEngine
    from dspark_serve.engine.params import SamplingParams
    from dspark_serve.eval.engine_runs import run_prompts
    from dspark_serve.eval.loading import chat_prompts
    from dspark_serve.eval.lookup_rounds import greedy_corpus_rounds, greedy_lookup_rounds

    engine = LLMEngine(EngineConfig(model=args.model, speculative="none", dtype=args.dtype,
                                    max_num_seqs=args.batch_size, seed=args.seed))
    if args.kind == "corpus":
        folder = Path(args.corpus) if args.corpus else shipped_corpus(engine.model_name)
        if folder is None:
            raise SystemExit(f"no corpus shipped for {engine.model_name}: pass --corpus")
        corpus = CorpusIndex(load_corpus(folder / CORPUS_FILE)[0])
        replay = lambda p, o: greedy_corpus_rounds(p, o, LOOKUP_GAMMA, corpus)
        max_key, out = num_keys(corpus.max_ngram), Path(args.out or folder / FILE_NAME)
    else:
        replay = lambda p, o: greedy_lookup_rounds(p, o, LOOKUP_GAMMA)
        max_key = 8
        out = Path(args.out or SHIPPED_DIR / engine.model_name / "ngram" / FILE_NAME)
    texts = load_prompts("sharegpt")[-args.num_prompts:]
    prompts = [p for p in chat_prompts(engine.tokenizer, texts)
               if len(p) + args.max_new_tokens < engine.max_model_len]
    outputs = run_prompts(engine, prompts, SamplingParams(temperature=0.0,
                                                          max_tokens=args.max_new_tokens))
    rounds = [replay(p, o.token_ids) for p, o in zip(prompts, outputs)]
    m, d, a = (np.concatenate([np.asarray(r[i], dtype=np.int64) for r in rounds])
               for i in range(3))
    hit = m > 0
    cal = fit_lookup_calibration(m[hit], d[hit], a[hit], LOOKUP_GAMMA, max_match=max_key,
                                 dataset=f"sharegpt last {len(prompts)} prompts, greedy, "
                                         f"{args.max_new_tokens} tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(out)
    print(f"rounds {m.size} ({int(hit.sum())} with a draft), tau {(a.sum() + m.size) / m.size:.3f}, "
          f"position-1 acceptance {float((a[hit] > 0).mean()):.3f} where drafted")
    for key, row in enumerate(cal.conditional, 1):
        print(f"{'key' if args.kind == 'corpus' else 'match'} {key}"
              f"{'+' if key == len(cal.conditional) and args.kind != 'corpus' else ' '}: "
              + " ".join(f"{c:.2f}" for c in row))
    print(f"wrote {out}")
    return 0
