"""``dspark-serve corpus``: the target's greedy answers to ShareGPT prompts, as the corpus of
hybrid's corpus lookup (``drafter.corpus_lookup``).

The first ``--num-prompts`` ShareGPT first user turns (``calibrate --kind ngram/corpus`` use
the last ones; MT-Bench, HumanEval and AlpacaEval are never used) are answered at temperature
0 by the engine (int4 by default: ~400 tokens/s per core at 16 requests), in chunks appended
to ``answers.jsonl``, so a stopped run resumes where it was; ``corpus.npz`` is written from
all answers at the end.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ANSWERS = "answers.jsonl"
CHUNK = 48   # prompts per appended chunk (a resumed run loses at most one chunk)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("corpus", help="answer ShareGPT prompts: hybrid's lookup corpus",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="corpus folder (an existing one resumes)")
    p.add_argument("--model", default=None, help="target HF folder (default: SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=4000, help="first ShareGPT prompts answered")
    p.add_argument("--shard", default="0/1",
                   help="I/N: answer every N-th prompt from the I-th (one process per core), "
                        "into answers-I.jsonl; the run with --shard 0/1 merges all shards")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together")
    p.add_argument("--quantization", choices=("none", "int4"), default="int4")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from dspark_serve.data.prompt_sets import load_prompts
    from dspark_serve.drafter.corpus_lookup import FILE_NAME, save_corpus
    from dspark_serve.engine.config import EngineConfig
    from dspark_serve.engine.llm_engine import LLMEngine
    from dspark_serve.engine.params import SamplingParams
    from dspark_serve.eval.engine_runs import run_prompts
    from dspark_serve.eval.loading import chat_prompts

    shard, num_shards = (int(x) for x in args.shard.split("/"))
    if not 0 <= shard < num_shards:
        raise SystemExit(f"--shard must be I/N with 0 <= I < N, got {args.shard}")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    answers = out / (ANSWERS if num_shards == 1 else f"answers-{shard}.jsonl")
    done = {json.loads(line)["index"] for path in out.glob("answers*.jsonl")
            for line in path.open()}
    todo = [i for i in range(shard, args.num_prompts, num_shards) if i not in done]
    engine = LLMEngine(EngineConfig(model=args.model, speculative="ngram",
                                    quantization=args.quantization,
                                    max_num_seqs=args.max_num_seqs, max_model_len=1024))
    texts = load_prompts("sharegpt", args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    start, tokens = time.time(), 0
    for s in range(0, len(todo), CHUNK):
        chunk = todo[s:s + CHUNK]
        prompts = chat_prompts(engine.tokenizer, [texts[i] for i in chunk])
        keep = [k for k, p in enumerate(prompts) if len(p) <= args.max_prompt_tokens]
        outputs = run_prompts(engine, [prompts[k] for k in keep], params)
        with answers.open("a") as f:
            for k, o in zip(keep, outputs):
                f.write(json.dumps({"index": chunk[k], "output_ids": o.token_ids}) + "\n")
                tokens += len(o.token_ids)
            for k in set(range(len(chunk))) - set(keep):   # skipped: never asked again
                f.write(json.dumps({"index": chunk[k], "output_ids": []}) + "\n")
        print(f"{s + len(chunk)}/{len(todo)} prompts, {tokens} tokens, "
              f"{tokens / (time.time() - start):.0f} tokens/s", flush=True)
    if num_shards == 1:
        rows = {}
        for path in sorted(out.glob("answers*.jsonl")):
            for line in path.open():
                row = json.loads(line)
                rows[row["index"]] = row["output_ids"]
        sequences = [rows[i] for i in sorted(rows) if rows[i]]
        save_corpus(out / FILE_NAME, sequences, {
            "model": engine.model_name, "prompts": f"sharegpt first {args.num_prompts}",
            "temperature": 0.0, "max_new_tokens": args.max_new_tokens,
            "quantization": args.quantization})
        print(f"wrote {out / FILE_NAME}: {len(sequences)} answers, "
              f"{sum(map(len, sequences))} tokens")
    return 0
