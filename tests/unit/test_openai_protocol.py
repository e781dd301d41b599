"""kimi_jax.entrypoints.openai.protocol without a server: bodies -> SamplingParams, errors naming the
field, and the streaming text that must add up to the final text."""
import pytest

from kimi_jax.entrypoints.openai import protocol as P


def test_completion_fields_map_onto_sampling_params():
    g = P.parse_completion({"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
                            "top_k": 0, "min_p": 0.1, "stop": "x", "seed": 3, "logprobs": 2, "n": 2,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    p = g.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.stop, p.seed, p.logprobs, p.ignore_eos) == \
        (7, 0.5, 0.9, -1, 0.1, ["x"], 3, 2, True)
    assert g.prompts == ("hi",) and g.n == 2 and g.stream and g.include_usage and g.logprobs == 2
    assert P.parse_completion({"prompt": [1, 2]}).prompts == ((1, 2),)
    assert P.parse_completion({"prompt": ["a", "b"]}).params.max_tokens == 16      # OpenAI's default
    chat = P.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5,
                         "logprobs": True})
    assert chat.params.max_tokens == 5 and chat.logprobs == 0 and chat.params.logprobs == 0
    assert P.parse_chat({"messages": [{"role": "user", "content": "x"}]}).params.max_tokens is None


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
])
def test_completion_errors_name_the_field(body, param):
    with pytest.raises(P.ProtocolError) as e:
        P.parse_completion(body)
    assert e.value.param == param and e.value.status == 400
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


def test_chat_errors_name_the_field():
    for body, param in [({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
                        ({"messages": [{}], "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{}], "tools": [{"type": "function"}]}, "tools"),
                        ({"messages": [{}], "response_format": {"type": "xml"}}, "response_format"),
                        ({"messages": [{}], "tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice")]:
        with pytest.raises(P.ProtocolError) as e:
            P.parse_chat(body)
        assert e.value.param == param, body
    with pytest.raises(P.ProtocolError):
        P.parse_completion([1])


def test_optional_sampling_fields_follow_sampling_params():
    """presence_penalty etc. pass through when SamplingParams has them; else only the no-op value."""
    import dataclasses
    from kimi_jax.engine.sampling import SamplingParams
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, (field, noop) in P.OPTIONAL_SAMPLING.items():
        assert P.parse_completion({"prompt": "x", name: noop}) is not None
        value = {1: 2.0} if name == "logit_bias" else (2 if name == "min_tokens" else 0.5)
        if field in fields:
            assert getattr(P.parse_completion({"prompt": "x", name: value}).params, field) == value
        else:
            with pytest.raises(P.ProtocolError) as e:
                P.parse_completion({"prompt": "x", name: value})
            assert e.value.param == name


class _Tok:
    """Characters as tokens (id = code point)."""
    def incremental_decoder(self, skip_special_tokens=True):
        class D:
            def feed_many(self, ids):
                return "".join(map(chr, ids))
        return D()


@pytest.mark.parametrize("stops", [[], ["xyz"], ["ab", "abcd"]])
def test_text_stream_never_sends_past_a_stop_string(stops):
    """Deltas held back by the longest stop string's length - 1 are always a prefix of the final text
    (the text up to the first stop string, which the engine finds after every token)."""
    text = "hello abxyz and abcd more"
    for size in (1, 2, 5):
        ts, sent, out = P.TextStream(_Tok(), stops), "", None
        for i in range(0, len(text), size):
            sofar = text[:i + size]
            hits = [sofar.find(s) for s in stops if s in sofar]
            if hits:
                out = sofar[:min(hits)]
                sent += ts.finish(out)
                break
            sent += ts.feed([ord(c) for c in text[i:i + size]])
            assert text.startswith(sent)
        else:
            out = text
            sent += ts.finish(text)
        assert sent == out
