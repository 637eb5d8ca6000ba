"""`make bench-guidellm`: GuideLLM's rate sweep against `disagg serve`, over the OpenAI-compatible
HTTP API (issue 37), with GuideLLM's own report.

Serves the default deployment (deploy/configs/disaggregated.yaml: the default model, 1 prefill + 1
decode worker) on free ports, saves the served model's tokenizer where GuideLLM can load it (the
model ships as a GGUF; GuideLLM sizes its synthetic prompts with it), then runs `guidellm run` from
its own virtual environment (`make bench-guidellm` makes it: .venv-guidellm) with a scenario of
constant request rates against `POST /v1/chat/completions`, streamed, and stops the server.

    .venv/bin/python -m loadtest.loadgen.guidellm --guidellm .venv-guidellm/bin/guidellm \\
        [--rates 0.5 1 2 3] [--seconds 30] [--prompt-tokens 128] [--output-tokens 32]
    .venv/bin/python -m loadtest.loadgen.guidellm --scenario-only   # the server side, no GuideLLM

Under --out-dir (default loadtest/results/guidellm): GuideLLM's report (benchmarks.json,
benchmarks.csv, benchmarks.html) and its console output (guidellm.log, the tables), the scenario
it ran (scenario.json), the server's log (serve.log). Goodput in GuideLLM's report is judged by the
server's default SLO, read over gRPC.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from disagg.bench.launcher import Deployment
from disagg.bench.results import REPO, host_line
from disagg.bench.workloads import load_tokenizer
from disagg.client import DisaggClient


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if not args.scenario_only and not Path(args.guidellm).is_file():
        sys.exit(f"no GuideLLM at {args.guidellm}: `make bench-guidellm` installs it in .venv-guidellm")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = _save_tokenizer(out / "tokenizer")
    print(host_line(), flush=True)
    print(f"starting `disagg serve --config {args.config}` (log: {out / 'serve.log'}) ...", flush=True)
    with Deployment(
        {}, base=args.config, workdir=out, name="serving-config", log=out / "serve.log", http=True
    ) as server:
        url = server.http_url
        scenario = _scenario(args, url, _served_model(url), str(tokenizer_dir), _server_slo(server.address), out)
        (out / "scenario.json").write_text(json.dumps(scenario, indent=2) + "\n")
        print(
            f"scenario: {out / 'scenario.json'} (model {scenario['spec']['backend']['model']}, SLO {_slo_text(scenario)})"
        )
        if args.scenario_only:
            return 0
        code = _run_guidellm(args, out)
    print(
        f"GuideLLM's report: {out / 'benchmarks.json'}, {out / 'benchmarks.html'}; its tables: {out / 'guidellm.log'}"
    )
    return code


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", default=str(REPO / ".venv-guidellm" / "bin" / "guidellm"))
    p.add_argument("--config", default=str(REPO / "deploy" / "configs" / "disaggregated.yaml"))
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0], help="requests/s")
    p.add_argument("--seconds", type=float, default=30.0, help="of arrivals at each rate")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the whole sweep may take")
    p.add_argument("--out-dir", default=str(REPO / "loadtest" / "results" / "guidellm"))
    p.add_argument(
        "--scenario-only", action="store_true", help="serve and write the scenario, then stop without running GuideLLM"
    )
    return p.parse_args(argv)


def _slo_text(scenario: dict) -> str:
    slo = scenario["spec"]["metrics"].get("slo", {})
    return ", ".join(f"{key} {value:g}" for key, value in slo.items()) or "none"


def _save_tokenizer(path: Path) -> Path:
    """The default model's tokenizer as a Hugging Face directory (it ships inside a GGUF)."""
    tokenizer, _ = load_tokenizer(None)
    tokenizer.save_pretrained(str(path))
    return path


def _served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def _server_slo(address: str) -> dict[str, float]:
    with DisaggClient(address) as client:
        slo = client.cluster_status(timeout=30).default_slo
    return {key: value for key, value in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms)) if value > 0}


def _scenario(args, url: str, model: str, tokenizer: str, slo: dict, out: Path) -> dict:
    """GuideLLM's scenario file: one benchmark per rate."""
    spec = {
        "backend": {
            "kind": "openai_http",
            "target": url,
            "model": model,
            "request_format": "/v1/chat/completions",
            "http2": False,  # disagg's HTTP API is HTTP/1.1; GuideLLM's HTTP/2 client waits forever on it
            # GuideLLM asks for usage in every chunk; disagg sends it once, in the last (as OpenAI)
            "extras": {"body": {"stream_options": {"continuous_usage_stats": False}}},
        },
        # constant intervals: GuideLLM 0.8.1's poisson profile sent every request of a rate at once here
        "profile": {"kind": "constant", "rate": args.rates[0]},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "constraints": [{"kind": "max_duration", "seconds": args.seconds}],
        "metrics": {"kind": "generative", **({"slo": slo} if slo else {})},
        "outputs": [
            {"kind": "console"},
            {"kind": "json", "path": str(out / "benchmarks.json")},
            {"kind": "csv", "path": str(out / "benchmarks.csv")},
            {"kind": "html", "path": str(out / "benchmarks.html")},
        ],
    }
    return {
        "metadata": {"name": "disagg-rate-sweep", "description": "constant rates against disagg serve"},
        "spec": spec,
        "benchmarks": [{"profile.rate": rate} for rate in args.rates],
    }


def _run_guidellm(args, out: Path) -> int:
    command = [args.guidellm, "run", "--scenario", str(out / "scenario.json"), "--disable-progress"]
    print("running " + " ".join(command), flush=True)
    with open(out / "guidellm.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    print((out / "guidellm.log").read_text()[-6000:])
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
