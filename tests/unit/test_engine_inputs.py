"""Bad input is refused with a ValueError that names the field, and the engine keeps serving;
sampling options (seeds, top-k/top-p, stop tokens and strings, logprobs, abort) behave as
vLLM users expect."""

from __future__ import annotations

import dataclasses

import pytest
from support import random_prompts

from disagg import LLM, SamplingParams

MODEL = "random:tiny"  # vocab 512, no tokenizer
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def llm():
    return LLM(model=MODEL, dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64)


@pytest.fixture
def engine(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    yield engine
    # Whatever the test did, nothing may be left behind.
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks


def _prompt(n: int = 10, seed: int = 0) -> list[int]:
    return random_prompts([n], 512, seed=seed)[0]


def _greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _unchecked(params: SamplingParams, **changes) -> SamplingParams:
    """SamplingParams with invalid fields set after construction (bypassing __post_init__),
    as a caller mutating a params object would produce."""
    params = dataclasses.replace(params)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


def _run(engine, ids: list[str], max_steps: int = 1000) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(ids) <= set(finals), f"unfinished: {set(ids) - set(finals)}"
    return finals


def _assert_still_serves(engine, tag: str) -> None:
    rid = f"good-after-{tag}"
    engine.add_request(rid, prompt_token_ids=_prompt(12), sampling_params=_greedy(6))
    out = _run(engine, [rid])[rid]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6


# --- bad input ---------------------------------------------------------------------------------

BAD_REQUESTS = {
    # tag: (add_request kwargs, field names any of which the message must mention)
    "empty-token-ids": (dict(prompt_token_ids=[]), ("prompt",)),
    "empty-text": (dict(prompt=""), ("prompt",)),
    "no-prompt": (dict(), ("prompt",)),
    "text-without-tokenizer": (dict(prompt="hello"), ("prompt",)),
    "token-id-out-of-vocab": (dict(prompt_token_ids=[5, 512]), ("prompt_token_ids",)),
    "negative-token-id": (dict(prompt_token_ids=[5, -1]), ("prompt_token_ids",)),
    "prompt-fills-context": (dict(prompt_token_ids=list(range(3, 3 + MAX_MODEL_LEN))), ("prompt",)),
    "prompt-plus-max-tokens-too-long": (
        dict(prompt_token_ids=list(range(3, 103)), sampling_params=_greedy(40)),
        ("max_tokens",),
    ),
    "max-tokens-0": (dict(sampling_params=_unchecked(_greedy(), max_tokens=0)), ("max_tokens",)),
    "temperature-negative": (dict(sampling_params=_unchecked(_greedy(), temperature=-0.5)), ("temperature",)),
    "top-p-0": (dict(sampling_params=_unchecked(_greedy(), top_p=0.0)), ("top_p",)),
    "top-p-1.5": (dict(sampling_params=_unchecked(_greedy(), top_p=1.5)), ("top_p",)),
    "top-k-minus-2": (dict(sampling_params=_unchecked(_greedy(), top_k=-2)), ("top_k",)),
    "not-sampling-params": (dict(sampling_params={"temperature": 0.0}), ("sampling_params",)),
    "stop-string-without-tokenizer": (dict(sampling_params=_greedy(stop=["x"])), ("stop",)),
}


@pytest.mark.parametrize("tag", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_engine_keeps_serving(engine, tag):
    kwargs, fields = BAD_REQUESTS[tag]
    kwargs = dict(kwargs)
    if "prompt" not in kwargs and "prompt_token_ids" not in kwargs and tag != "no-prompt":
        kwargs["prompt_token_ids"] = _prompt(8)
    free_before = engine.num_free_blocks
    with pytest.raises(ValueError) as info:
        engine.add_request(f"bad-{tag}", **kwargs)
    assert any(f in str(info.value) for f in fields), f"message {str(info.value)!r} names none of {fields}"
    assert engine.num_free_blocks == free_before and not engine.has_unfinished_requests()
    _assert_still_serves(engine, tag)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("logprobs", 21),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("stop", ["x"] * 65),
        ("stop", ["x" * 1025]),
        ("stop_token_ids", list(range(1025))),
    ],
)
def test_sampling_params_constructor_validates(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("dup", prompt_token_ids=_prompt(8), sampling_params=_greedy(4))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", prompt_token_ids=_prompt(9), sampling_params=_greedy(4))
    out = _run(engine, ["dup"])["dup"]
    assert len(out.outputs[0].token_ids) == 4


def test_generate_with_a_bad_prompt_leaves_nothing_behind(llm, engine):
    good = {"prompt_token_ids": _prompt(8)}
    with pytest.raises(ValueError):
        llm.generate([good, {"prompt_token_ids": []}], _greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [_greedy(4)], use_tqdm=False)
    # A half-added batch must not linger: the next call sees only its own requests.
    outs = llm.generate([good], _greedy(4), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 4
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "model", ["/nonexistent/model/dir", "/nonexistent/model.gguf", "random:no-such-shape", "random:", " "]
)
def test_unknown_model_is_a_value_error(model):
    with pytest.raises(ValueError):
        LLM(model=model)


def test_model_dir_without_weights_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError):
        LLM(model=str(tmp_path))


# --- sampling ----------------------------------------------------------------------------------


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_same_seed_same_tokens_different_seed_different(llm, engine):
    prompt = {"prompt_token_ids": _prompt(20, seed=5)}
    other = {"prompt_token_ids": _prompt(30, seed=6)}

    def sp(seed):
        return SamplingParams(temperature=0.8, seed=seed, max_tokens=24, ignore_eos=True)

    a, b, c, _ = _tokens(
        llm.generate(
            [prompt, prompt, prompt, other],
            [sp(1), sp(1), sp(2), SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)],
            use_tqdm=False,
        )
    )
    assert a == b, "two requests with the same seed in one batch must sample the same tokens"
    assert a != c, "different seeds gave the same 24 tokens"
    # Alone, in another call: the seed alone decides, not the batch it runs in.
    (alone,) = _tokens(llm.generate([prompt], sp(1), use_tqdm=False))
    assert alone == a


def test_a_resumed_request_continues_its_seeded_stream(llm, engine):
    """What a migration does: prompt + the tokens so far, `resumed_tokens` of them, on a fresh
    request: the rest equals the uninterrupted run."""
    prompt = _prompt(20, seed=5)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    (whole,) = _tokens(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False))
    done = whole[:6]
    rest = dataclasses.replace(params, max_tokens=10, resumed_tokens=6)
    (tail,) = _tokens(llm.generate([{"prompt_token_ids": prompt + done}], rest, use_tqdm=False))
    assert done + tail == whole
    fresh = dataclasses.replace(params, max_tokens=10)  # without the index, the stream restarts
    (restarted,) = _tokens(llm.generate([{"prompt_token_ids": prompt + done}], fresh, use_tqdm=False))
    assert restarted != tail


def test_unseeded_sampling_varies(llm, engine):
    prompt = {"prompt_token_ids": _prompt(20, seed=5)}
    outs = _tokens(
        llm.generate([prompt] * 4, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    )
    assert len({tuple(t) for t in outs}) > 1


def test_top_k_1_and_tiny_top_p_equal_greedy(llm, engine):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 40], 512, seed=9)]
    greedy = _tokens(llm.generate(prompts, _greedy(16), use_tqdm=False))
    top_k = _tokens(
        llm.generate(
            prompts, SamplingParams(temperature=0.8, top_k=1, max_tokens=16, ignore_eos=True, seed=3), use_tqdm=False
        )
    )
    top_p = _tokens(
        llm.generate(
            prompts, SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=16, ignore_eos=True, seed=3), use_tqdm=False
        )
    )
    assert top_k == greedy
    assert top_p == greedy


def test_top_k_beyond_the_vocabulary_samples_from_all_of_it(llm, engine):
    """Not a crash of the step (and of the batch with it): top_k of 2^31 - 1 is no top-k."""
    prompt = {"prompt_token_ids": _prompt(12, seed=4)}

    def sp(top_k):
        return SamplingParams(temperature=0.8, top_k=top_k, max_tokens=12, ignore_eos=True, seed=9)

    (huge,) = _tokens(llm.generate([prompt], sp(2**31 - 1), use_tqdm=False))
    (off,) = _tokens(llm.generate([prompt], sp(-1), use_tqdm=False))
    assert huge == off


def test_stop_token_ids_finish_with_stop(llm, engine):
    prompt = {"prompt_token_ids": _prompt(15, seed=2)}
    (full,) = _tokens(llm.generate([prompt], _greedy(24), use_tqdm=False))
    stop_token = full[6]
    k = full.index(stop_token)
    (out,) = llm.generate([prompt], _greedy(24, stop_token_ids=[stop_token]), use_tqdm=False)
    # vLLM keeps the stop token id in token_ids and reports it as the stop reason.
    assert list(out.outputs[0].token_ids) == full[: k + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_token


def test_max_tokens_finishes_with_length(llm, engine):
    outs = llm.generate([{"prompt_token_ids": _prompt(5)}] * 3, [_greedy(1), _greedy(7), _greedy(23)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 7, 23]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    for o in outs:
        m = o.metrics
        assert m.arrival <= m.first_scheduled <= m.first_token <= m.finished
        assert 0 <= m.ttft <= m.e2e


def test_generation_stops_at_max_model_len(engine):
    """max_tokens that fits exactly ends at the context limit with "length"."""
    n = MAX_MODEL_LEN - 10
    engine.add_request("edge", prompt_token_ids=list(range(3, 3 + n)), sampling_params=_greedy(10))
    out = _run(engine, ["edge"])["edge"]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_logprobs(llm, engine):
    prompt = {"prompt_token_ids": _prompt(12)}
    two, zero, none = llm.generate(
        [prompt] * 3, [_greedy(6, logprobs=2), _greedy(6, logprobs=0), _greedy(6)], use_tqdm=False
    )
    tokens = list(two.outputs[0].token_ids)
    assert len(two.outputs[0].logprobs) == len(tokens)
    for token, entry in zip(tokens, two.outputs[0].logprobs):
        values = {t: getattr(v, "logprob", v) for t, v in entry.items()}
        assert token in values, "the chosen token is always included"
        assert len(values) == 2, "greedy: the chosen token is one of the top 2"
        assert all(v <= 0 for v in values.values())
        assert values[token] == max(values.values())
    for token, entry in zip(tokens, zero.outputs[0].logprobs):
        assert list(entry) == [token]
    assert none.outputs[0].logprobs is None
    assert list(zero.outputs[0].token_ids) == tokens == list(none.outputs[0].token_ids)


def test_sampled_logprobs_include_unlikely_choice(llm, engine):
    """With sampling the chosen token may fall outside the top n: it is added (n + 1 entries)."""
    prompt = {"prompt_token_ids": _prompt(12)}
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=5.0, max_tokens=32, ignore_eos=True, seed=0, logprobs=1), use_tqdm=False
    )
    for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert token in entry and len(entry) in (1, 2)


def test_abort_mid_generation_frees_blocks(engine):
    for i in range(3):
        engine.add_request(f"ab{i}", prompt_token_ids=_prompt(20 + i, seed=i), sampling_params=_greedy(60))
    for _ in range(5):
        engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    engine.add_request("ab-waiting", prompt_token_ids=_prompt(30), sampling_params=_greedy(60))
    engine.abort_request("ab-waiting")
    engine.abort_request("ab1")
    engine.abort_request("no-such-request")  # unknown ids are ignored, as in vLLM
    seen_after_abort = set()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen_after_abort.add(out.request_id)
            if out.finished:
                finals[out.request_id] = out
    assert "ab1" not in seen_after_abort and "ab-waiting" not in seen_after_abort
    assert set(finals) == {"ab0", "ab2"}
    assert all(len(o.outputs[0].token_ids) == 60 for o in finals.values())
    # abort everything mid-flight
    for i in range(3):
        engine.add_request(f"ac{i}", prompt_token_ids=_prompt(40, seed=i), sampling_params=_greedy(50))
    for _ in range(3):
        engine.step()
    for i in range(3):
        engine.abort_request(f"ac{i}")
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks


def test_a_step_error_fails_only_the_request_that_caused_it(engine):
    """A request that passed validation and still breaks the step (here: logprobs beyond the
    vocabulary, set behind validation's back) ends with an error; its batch goes on as if it
    had never been there, seeded sampling included."""
    innocents = {
        "ok-greedy": _greedy(12),
        "ok-seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        "ok-long": _greedy(20),
    }

    def add_innocents(tag):
        for i, (rid, params) in enumerate(innocents.items()):
            engine.add_request(f"{rid}-{tag}", prompt_token_ids=_prompt(10 + i, seed=i), sampling_params=params)

    add_innocents("alone")
    alone = _run(engine, [f"{rid}-alone" for rid in innocents])
    add_innocents("beside")
    engine.add_request("culprit", prompt_token_ids=_prompt(15, seed=9), sampling_params=_greedy(12))
    engine.step()  # every request's prompt runs in this first step
    engine.scheduler.requests["culprit"].sampling_params.logprobs = 10**6  # topk() past the vocabulary raises
    beside = _run(engine, [f"{rid}-beside" for rid in innocents] + ["culprit"])
    culprit = beside["culprit"]
    assert culprit.error and "RuntimeError" in culprit.error and culprit.outputs[0].finish_reason == "abort"
    for rid in innocents:
        assert beside[f"{rid}-beside"].error is None
        assert beside[f"{rid}-beside"].outputs[0].token_ids == alone[f"{rid}-alone"].outputs[0].token_ids, rid


# --- stop strings need a tokenizer: the default model --------------------------------------------


@pytest.mark.slow
def test_stop_strings_cut_text():
    llm = LLM(dtype="float32", num_kv_blocks=64)
    prompt = "Once upon a time, in a small village by the sea,"
    (full,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    text = full.outputs[0].text
    words = text.split()
    assert len(words) > 8, text
    stop = words[len(words) // 2]
    cut = text.index(stop)

    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    assert out.outputs[0].text == text[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.outputs[0].token_ids) < len(full.outputs[0].token_ids)

    (kept,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: cut + len(stop)]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
