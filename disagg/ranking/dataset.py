"""The length ranker's training data: (prompt token ids, output length) pairs, measured by
running the project's default model greedily on templated chat requests (disagg.ranking.prompts).

    python -m disagg.ranking.dataset --out loadtest/data/ranking_smollm2.jsonl --n 400

One JSON object a line: {"prompt_token_ids": [...], "output_len": n, "template": ..., "split": ...}.
Greedy decoding makes a prompt's length a fact of the model, not of a sample; the output is
capped at `max_tokens`, so the longest answers all read as that cap.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from disagg.ranking.prompts import PromptSpec, make_prompts

DEFAULT_MAX_TOKENS = 256
BATCH = 32  # prompts per generate call: enough to batch decodes, few enough to keep KV small


def load_model(max_tokens: int):
    from disagg import LLM  # the engine is needed only to make data, not to read it

    blocks = BATCH * (128 + max_tokens) // 16 + 64  # a chat prompt here is well under 128 tokens
    return LLM(num_kv_blocks=blocks, weights="auto", max_num_seqs=BATCH, num_threads=1)


def chat_ids(llm, text: str) -> list[int]:
    return list(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def measure(llm, specs: list[PromptSpec], max_tokens: int) -> list[dict]:
    """Each prompt's greedy output length, `BATCH` prompts per generate call."""
    from disagg import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    records = []
    for start in range(0, len(specs), BATCH):
        batch = specs[start : start + BATCH]
        ids = [chat_ids(llm, spec.text) for spec in batch]
        outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        for spec, prompt_ids, out in zip(batch, ids, outputs):
            records.append(_record(spec, prompt_ids, len(out.outputs[0].token_ids)))
    return records


def _record(spec: PromptSpec, prompt_ids: list[int], output_len: int) -> dict:
    return {
        "prompt_token_ids": prompt_ids,
        "output_len": output_len,
        "template": spec.template,
        "split": spec.split,
        "text": spec.text,
    }


def write_jsonl(records: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    args = parser.parse_args(argv)
    llm = load_model(args.max_tokens)
    start = time.perf_counter()
    records = measure(llm, make_prompts(args.n, args.seed), args.max_tokens)
    seconds = time.perf_counter() - start
    write_jsonl(records, args.out)
    tokens = sum(r["output_len"] for r in records)
    print(f"{len(records)} prompts, {tokens} output tokens in {seconds:.0f} s ({tokens / seconds:.1f} tokens/s)")


if __name__ == "__main__":
    main()
