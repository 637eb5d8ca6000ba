"""The engine's perplexity of the default GGUF against llama.cpp's own, on the same text (issue 38).

The check that the quantized compute is right: `llama-perplexity -c 512` on a fixed text, and
the engine's estimate made the same way (disagg.engine.scoring: windows of 512 tokens, the
second half of each scored). The engine is scored with its weights kept quantized (`auto`)
through each path a token can take: whole windows as prefill steps (the wide bfloat16 GEMMs) and
one position per step (the decode path: the int4/int8 kernels and decode attention); and dense
float32 (the GGUF dequantized). Target: within 1% of llama.cpp's.

    .venv/bin/python -m loadtest.engine.perplexity [--llamacpp] [--text FILE]

`--llamacpp` builds llama.cpp once (minutes, cached: loadtest/peers/llamacpp.py) and runs its tool in
the same run; without it the reference is LLAMACPP_PPL, measured so (RESULTS.md says when).
`--windows N` scores only the first N windows (a quick run; not comparable with llama.cpp's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from disagg.bench.results import host_line, write_results

TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity_pydoc.txt"
CONTEXT = 512
LLAMACPP_PPL = 13.1431  # llama-perplexity -c 512 -t 2 on TEXT, llama.cpp of llama-cpp-python 0.3.36
SIDES = {"auto, prefill path": ("auto", None), "auto, decode path": ("auto", 1), "fp32": ("fp32", None)}


def side(weights: str, step_tokens: int | None, text: str, windows: int | None) -> dict:
    """One engine's estimate (run in a subprocess of its own: one model in memory at a time)."""
    import torch

    from disagg import LLM
    from disagg.engine.scoring import perplexity

    torch.set_num_threads(2)
    llm = LLM(num_kv_blocks=64, weights=weights, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(Path(text).read_text())
    if windows is not None:
        ids = ids[: windows * CONTEXT]
    started = time.perf_counter()
    found = perplexity(llm.engine, ids, CONTEXT, step_tokens)
    return {"ppl": found.value, "stderr": found.stderr, "windows": found.num_windows,
            "seconds": time.perf_counter() - started}  # fmt: skip


def run_side(weights: str, step_tokens: int | None, text: Path, windows: int | None) -> dict:
    code = (
        f"import json, {__spec__.name} as b; "
        f"print(json.dumps(b.side({weights!r}, {step_tokens!r}, {str(text)!r}, {windows!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{weights} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_reference(text: Path) -> float:
    from disagg.engine.loader import default_gguf_path
    from loadtest.peers import llamacpp

    ppl, command = llamacpp.perplexity(llamacpp.binaries()["llama-perplexity"], default_gguf_path(), text, CONTEXT)
    print(f"llama.cpp: {command}", flush=True)
    return ppl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--llamacpp", action="store_true", help="run llama-perplexity now (builds llama.cpp once)")
    p.add_argument("--windows", type=int, help="score only this many windows")
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    print(host_line(), flush=True)
    reference = llamacpp_reference(args.text) if args.llamacpp else LLAMACPP_PPL
    print(f"llama.cpp PPL {reference:.4f}{'' if args.llamacpp else ' (recorded)'}", flush=True)
    figures = {"llamacpp_ppl": reference}
    for name in args.sides:
        found = run_side(*SIDES[name], args.text, args.windows)
        found["ratio"] = found["ppl"] / reference
        figures[name] = found
        print(f"{name}: PPL {found['ppl']:.4f} +/- {found['stderr']:.4f} over {found['windows']} windows, "
              f"ratio to llama.cpp {found['ratio']:.4f} ({found['seconds']:.0f} s)", flush=True)  # fmt: skip
    if args.json:
        write_results(args.json, figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
