"""Seeded benchmark workloads made of real text, sized in tokens with the model's tokenizer.

- chat:          ShareGPT-shaped lengths (heavy-tailed prompts and replies; a question, then context)
- code:          code completion: a long window of a Python file, a short completion
- summarization: a long article, a medium summary
- fixed:         every request the same prompt and output length (prose)

Long-prompt workloads take their lengths as fractions of the model's context; every request
fits the context (prompt + output). `length_scale` shrinks or grows every length, e.g. for a CPU.
The same (workload, seed, sizes) always gives the same requests; request i's text depends only
on (workload, seed, i). The text is assembled from the banks below (written for this project,
no downloads); it is ASCII so that any token window of it decodes to the same text.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORKLOADS = ("chat", "code", "summarization", "fixed")
MIN_OUTPUT_LEN = 2  # TPOT needs two tokens
MIN_PROMPT_LEN = 8


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # sent as plain text (no chat template)
    prompt_len: int  # tokens of `prompt` with the model's tokenizer, as the server counts them
    output_len: int  # tokens to generate (max_tokens, EOS ignored)


@dataclass(frozen=True)
class WorkloadConfig:
    name: str = "chat"
    num_requests: int = 100
    seed: int = 0
    context_len: int = 8192  # the model's (or the server's max_model_len)
    length_scale: float = 1.0
    input_len: int = 256  # fixed workload only
    output_len: int = 64  # fixed workload only

    def __post_init__(self):
        if self.name not in WORKLOADS:
            raise ValueError(f"workload: {self.name!r} is not one of {', '.join(WORKLOADS)}")
        if self.num_requests < 0 or self.length_scale <= 0 or self.context_len < MIN_PROMPT_LEN + MIN_OUTPUT_LEN:
            raise ValueError(
                "workload: num_requests >= 0, length_scale > 0 and a context of at least 10 tokens are required"
            )


def make_workload(config: WorkloadConfig, tokenizer) -> list[BenchRequest]:
    """`tokenizer`: a Hugging Face tokenizer (encode / decode), the one the server uses."""
    prompt_lens, output_lens = sample_lengths(config)
    build = _BUILDERS[config.name]
    requests = []
    for i, (n_in, n_out) in enumerate(zip(prompt_lens, output_lens)):
        rng = random.Random(f"{config.name}-{config.seed}-{i}")
        prompt, n = _fit_prompt(tokenizer, build, rng, int(n_in))
        requests.append(BenchRequest(prompt, n, int(n_out)))
    return requests


def sample_lengths(config: WorkloadConfig) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths) in tokens, scaled, clipped and fitting the context."""
    rng = np.random.default_rng([config.seed, WORKLOADS.index(config.name)])
    n, ctx = config.num_requests, config.context_len
    if config.name == "chat":
        # ShareGPT's first turns: lognormal-ish, long-tailed; vLLM drops prompts over 1,024 and
        # pairs over 2,048 tokens (for 2k-context models), so caps grow with the context.
        prompts, outputs = rng.lognormal(np.log(160), 1.0, n), rng.lognormal(np.log(140), 0.8, n)
        max_prompt, max_output = min(1024, ctx // 2), min(1024, ctx // 2)
    elif config.name == "code":
        prompts, outputs = rng.uniform(ctx / 16, ctx / 8, n), rng.uniform(8, 48, n)
        max_prompt, max_output = ctx, ctx
    elif config.name == "summarization":
        prompts, outputs = rng.uniform(ctx / 16, ctx / 5, n), rng.uniform(64, 192, n)
        max_prompt, max_output = ctx, ctx
    else:
        prompts, outputs = np.full(n, float(config.input_len)), np.full(n, float(config.output_len))
        max_prompt, max_output = ctx, ctx
    prompts = np.clip(
        np.rint(prompts * config.length_scale), MIN_PROMPT_LEN, min(max_prompt, ctx - MIN_OUTPUT_LEN)
    ).astype(int)
    outputs = np.clip(np.rint(outputs * config.length_scale), MIN_OUTPUT_LEN, max_output).astype(int)
    return prompts, np.minimum(outputs, ctx - prompts)


def _fit_prompt(tokenizer, build: Callable, rng: random.Random, target: int) -> tuple[str, int]:
    """The builder's text cut to at most `target` tokens (re-encoding can merge across the cut)."""
    prefix, body_ids, suffix, keep_tail = build(tokenizer, rng, target)
    budget = max(1, target - len(tokenizer.encode(prefix + suffix)) if prefix or suffix else target)
    for _ in range(8):
        window = body_ids[-budget:] if keep_tail else body_ids[:budget]
        text = prefix + tokenizer.decode(window) + suffix
        n = len(tokenizer.encode(text))
        if n <= target or budget == 1:
            return text, n
        budget -= n - target
    return text, n


def _encode_at_least(tokenizer, make_text: Callable[[], str], tokens: int) -> list[int]:
    """Append generated text until it is at least `tokens` long (about 4 characters a token)."""
    parts: list[str] = []
    ids: list[int] = []
    while len(ids) < tokens:
        chars = 5 * (tokens - len(ids)) + 40
        while chars > 0:
            parts.append(make_text())
            chars -= len(parts[-1])
        ids = tokenizer.encode("".join(parts))
    return ids


# ---- text banks -------------------------------------------------------------------------------
NOUNS = [
    "river",
    "library",
    "harbor",
    "garden",
    "bridge",
    "market",
    "village",
    "mountain",
    "forest",
    "railway",
    "lighthouse",
    "orchard",
    "museum",
    "workshop",
    "observatory",
    "valley",
    "castle",
    "bakery",
    "school",
    "island",
    "meadow",
    "factory",
    "canal",
    "windmill",
    "archive",
    "theater",
    "monastery",
    "vineyard",
    "glacier",
    "desert",
]
PEOPLE = [
    "the engineer",
    "the old captain",
    "a young teacher",
    "the mayor",
    "a traveling merchant",
    "the gardener",
    "two farmers",
    "the librarian",
    "a retired sailor",
    "the doctor",
]
ADJECTIVES = [
    "quiet",
    "ancient",
    "narrow",
    "busy",
    "forgotten",
    "golden",
    "crowded",
    "windy",
    "modest",
    "remarkable",
    "fragile",
    "distant",
]
VERBS = [
    "repaired",
    "described",
    "measured",
    "visited",
    "painted",
    "studied",
    "rebuilt",
    "mapped",
    "defended",
    "explored",
]
TOPICS = [
    "weather",
    "trade",
    "history",
    "farming",
    "music",
    "bridges",
    "tides",
    "bread",
    "clocks",
    "maps",
    "bees",
    "lanterns",
]
SENTENCES = [
    "The {adj} {noun} stood at the edge of town for more than {num} years.",
    "Every morning {person} walked past the {noun} and counted the boats in the harbor.",
    "Nobody remembered who first {verb} the {noun}, but everyone had a story about it.",
    "In the spring of {year} a storm flooded the {noun}, and the whole valley helped to clear it.",
    "{Person} kept a notebook about {topic}, filled with careful drawings and small numbers.",
    "The path to the {noun} was {adj}, lined with stones that travelers had carried there one by one.",
    "By noon the {noun} was {adj} again, and the smell of fresh bread drifted across the square.",
    "It took {num} workers almost a year to finish the new {noun}, and they celebrated with music.",
    "Children liked to ask {person} why the {noun} was built so far from the road.",
    "According to the records, the {noun} was {verb} in {year} after a long argument about money.",
    "When the trains stopped running, the {noun} became the center of village life.",
    "{Person} believed that {topic} explained most of what happened in the {noun}.",
    "The council voted to protect the {adj} {noun}, although many people thought it was too expensive.",
    "At night the lights of the {noun} could be seen from the top of the hill.",
    "The visitors wrote in the guest book that the {noun} was the most {adj} place they had seen.",
    "A small museum now explains how the {noun} changed the way people thought about {topic}.",
    "Each winter the {noun} closed for {num} days while the roof was checked and repaired.",
    "Some historians argue that the {noun} mattered less than the roads that led to it.",
    "{Person} {verb} the {noun} twice, once as a student and once many years later.",
    "The first map of the region shows the {noun} as a small square next to the river.",
]
QUESTIONS = [
    "Can you explain why the {noun} became so important for {topic}?",
    "What is the best way to learn about {topic} if I live near a {noun}?",
    "Could you write a short story about {person} and the {adj} {noun}?",
    "How would you describe the history of the {noun} to a child?",
    "Please give me three ideas for a weekend trip to a {adj} {noun}.",
    "Why do people still care about {topic} today?",
    "What questions should I ask when I visit the {noun}?",
    "Summarize what is known about the {noun} and its role in {topic}.",
]
TITLES = [
    "The {adj} {noun}",
    "A History of the {noun}",
    "Notes on {topic} and the {noun}",
    "How the {noun} Changed the Valley",
]

IDENTS = ["record", "order", "item", "user", "event", "block", "token", "batch", "queue", "node", "price", "route"]
CODE_TEMPLATES = [
    'def {verb}_{a}s({a}s, limit={num}):\n    """Return the {a}s whose size is below the limit."""\n    result = []\n    for {a} in {a}s:\n        if len({a}.{b}s) < limit:\n            result.append({a})\n    return result\n\n\n',
    "def count_{a}s_by_{b}({a}s):\n    counts = {{}}\n    for {a} in {a}s:\n        key = {a}.{b}\n        counts[key] = counts.get(key, 0) + 1\n    return counts\n\n\n",
    'class {A}{B}Index:\n    """Maps each {b} to the {a}s that refer to it."""\n\n    def __init__(self):\n        self._by_{b} = {{}}\n\n    def add(self, {a}):\n        self._by_{b}.setdefault({a}.{b}, []).append({a})\n\n    def find(self, {b}):\n        return list(self._by_{b}.get({b}, []))\n\n\n',
    'def merge_{a}s(left, right):\n    """Merge two sorted lists of {a}s by their {b}."""\n    i = j = 0\n    merged = []\n    while i < len(left) and j < len(right):\n        if left[i].{b} <= right[j].{b}:\n            merged.append(left[i])\n            i += 1\n        else:\n            merged.append(right[j])\n            j += 1\n    return merged + left[i:] + right[j:]\n\n\n',
    'async def fetch_{a}(client, {a}_id, retries={small}):\n    for attempt in range(retries):\n        try:\n            return await client.get(f"/{a}s/{{{a}_id}}", timeout={num})\n        except TimeoutError:\n            if attempt == retries - 1:\n                raise\n    return None\n\n\n',
    '@dataclass\nclass {A}:\n    {b}: int\n    name: str = ""\n    tags: list[str] = field(default_factory=list)\n\n    def is_valid(self) -> bool:\n        return self.{b} >= 0 and bool(self.name)\n\n\n',
    "def test_{verb}_{a}s_keeps_order():\n    {a}s = [make_{a}({b}=i) for i in range({num})]\n    assert [x.{b} for x in {verb}_{a}s({a}s)] == sorted(x.{b} for x in {a}s)\n\n\n",
]
CODE_VERBS = ["filter", "select", "group", "load", "parse", "validate", "normalize", "collect"]


def _fill(template: str, rng: random.Random) -> str:
    person = rng.choice(PEOPLE)
    a, b = rng.sample(IDENTS, 2)
    return template.format(
        adj=rng.choice(ADJECTIVES),
        noun=rng.choice(NOUNS),
        person=person,
        Person=person[0].upper() + person[1:],
        verb=rng.choice(VERBS),
        topic=rng.choice(TOPICS),
        num=rng.randint(3, 400),
        year=rng.randint(1700, 1990),
        a=a,
        b=b,
        A=a.capitalize(),
        B=b.capitalize(),
        small=rng.randint(2, 5),
    )


def _code_fill(template: str, rng: random.Random) -> str:
    return _fill(template.replace("{verb}", rng.choice(CODE_VERBS)), rng)


def _sentence(rng: random.Random) -> str:
    return _fill(rng.choice(SENTENCES), rng) + (" " if rng.random() < 0.8 else "\n\n")


def _prose_builder(tokenizer, rng, target):
    return "", _encode_at_least(tokenizer, lambda: _sentence(rng), target), "", False


def _chat_builder(tokenizer, rng, target):
    opening = _fill(rng.choice(QUESTIONS), rng) + " Some background: "
    texts = iter([opening])
    return "", _encode_at_least(tokenizer, lambda: next(texts, None) or _sentence(rng), target), "", False


def _code_builder(tokenizer, rng, target):
    # A window onto the end of a file, ending in a function to complete (what an IDE sends).
    prefix = f"# {rng.choice(IDENTS)}_{rng.choice(CODE_VERBS)}.py\n"
    last = _code_fill(rng.choice(CODE_TEMPLATES), rng)
    suffix = last[: last.index(":\n") + 2]  # up to its signature
    return (
        prefix,
        _encode_at_least(tokenizer, lambda: _code_fill(rng.choice(CODE_TEMPLATES), rng), target),
        suffix,
        True,
    )


def _summarization_builder(tokenizer, rng, target):
    prefix = "Summarize the following article in a few sentences.\n\n" + _fill(rng.choice(TITLES), rng) + "\n\n"
    return prefix, _encode_at_least(tokenizer, lambda: _sentence(rng), target), "\n\nSummary:", False


_BUILDERS = {
    "chat": _chat_builder,
    "code": _code_builder,
    "summarization": _summarization_builder,
    "fixed": _prose_builder,
}


def describe(config: WorkloadConfig, requests: list[BenchRequest]) -> dict:
    """What a result file records about its workload."""
    prompt = [r.prompt_len for r in requests] or [0]
    output = [r.output_len for r in requests] or [0]
    return {
        "name": config.name,
        "seed": config.seed,
        "num_requests": len(requests),
        "context_len": config.context_len,
        "length_scale": config.length_scale,
        "mean_prompt_len": float(np.mean(prompt)),
        "max_prompt_len": int(max(prompt)),
        "mean_output_len": float(np.mean(output)),
        "max_output_len": int(max(output)),
        **({"input_len": config.input_len, "output_len": config.output_len} if config.name == "fixed" else {}),
    }


def load_tokenizer(model: str | None = None):
    """(Hugging Face tokenizer, context length) of a model spec, as the server would load it. A
    Hugging Face directory without weights serves too (config.json and the tokenizer's files, as
    `make gpu-kit` carries the default model's to a GPU machine): only those two are read."""
    from disagg.config import DEFAULT_MODEL, EngineConfig
    from disagg.engine.loader import load_hf_tokenizer, load_model_source, read_hf_config

    spec = model or DEFAULT_MODEL
    if _is_weightless_hf_dir(spec):
        tokenizer, context = load_hf_tokenizer(spec), read_hf_config(spec).max_position_embeddings
    else:
        source = load_model_source(spec, cache_dir=EngineConfig().cache_dir)
        tokenizer, context = source.tokenizer, source.config.max_position_embeddings
    if tokenizer is None:
        raise ValueError(f"model: {model!r} has no tokenizer; text workloads need one")
    return tokenizer, context


def _is_weightless_hf_dir(spec: str) -> bool:
    folder = Path(spec).expanduser()
    return (folder / "config.json").is_file() and not any(folder.glob("*.safetensors"))
