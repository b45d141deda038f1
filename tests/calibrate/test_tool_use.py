"""Tool-using traffic: read as OpenAI logs it, sampled with its tools and calls, scrubbed, keyed and rendered as
vLLM renders it."""

import json

import pytest
import tiny
from tiny import TOOL_TEMPLATE, WEATHER

from qgate.calibrate.reader import Reject, Request, read_traffic
from qgate.calibrate.sample import SampleConfig, sample_traffic, split_prompts, split_rows
from qgate.calibrate.scrub import scrub
from qgate.chat import prompt_digest, render, request_from_turns, request_turns, row_digest, served_messages

MAIL = {"type": "function", "function": {"name": "send_mail", "parameters": {"type": "object", "properties": {}}}}


def _agent(i: int, email: str = "jo.bloggs@example.com") -> dict:
    """A request after one tool round trip: the user's question, the assistant's call (no text), the result."""
    args = json.dumps({"city": f"city {i}", "notify": email})
    call = {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    return {
        "messages": [
            {"role": "system", "content": "You can call tools."},
            {"role": "user", "content": f"question {i}: what is the weather there, and mail me the answer"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f"{i % 30} C and dry"},
            {"role": "assistant", "content": "It is dry."},  # the logged answer: not part of the request
        ],
        "tools": [WEATHER, MAIL],
        "route": "agent",
    }


def test_a_tool_round_trip_is_read_up_to_its_result_with_its_tools_and_call(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_agent(7)) + "\n")
    (req,) = list(read_traffic(path))
    assert isinstance(req, Request)
    roles = [r for r, _ in req.messages]
    assert roles == ["tools", "system", "user", "fields", "assistant", "fields", "tool"]  # the answer left out
    messages, tools = request_from_turns(list(req.messages))
    assert tools == [WEATHER, MAIL]
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": _agent(7)["messages"][2]["tool_calls"]}
    assert messages[3] == {"role": "tool", "content": "7 C and dry", "tool_call_id": "c7"}
    assert request_turns(messages, tools) == list(req.messages)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: r["messages"][2]["tool_calls"][0].pop("function"), "messages[2].tool_calls[0] has no 'function'"),
        (lambda r: r.update(tools={"name": "x"}), "'tools' has type dict, not a list"),
        (lambda r: r.update(tools="[not json"), "'tools' is a string that is not JSON"),
        (lambda r: r.update(tools=[{"type": "function"}]), "tools[0] is not a function tool"),
        (lambda r: r["messages"][3].update(tool_call_id=3), "messages[3].tool_call_id has type int, not a string"),
        (lambda r: r["messages"][3].update(content=" "), "the last tool message (messages[3]) is empty"),
        (
            lambda r: r["messages"][2].update(tool_calls=None, function_call={"name": "f", "arguments": "{}"}),
            "messages[2] is a legacy 'function_call' with no text content: log the call as 'tool_calls'",
        ),
    ],
)
def test_malformed_tool_use_is_rejected_saying_what_is_wrong(tmp_path, change, reason):
    record = _agent(1)
    change(record)
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (item,) = list(read_traffic(path))
    assert isinstance(item, Reject) and item.reason.startswith(reason), item


def test_parquet_exports_of_tool_traffic_read_as_their_jsonl_does(tmp_path):
    """A Parquet column of the union type fills every key a row lacks with null (a tool without `description`, a
    user turn's `tool_calls`); tools are also exported as JSON text. Both read as the JSONL log does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [_agent(i) for i in range(3)] + [{"messages": [{"role": "user", "content": "plain"}], "route": "chat"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    want = [r.messages for r in read_traffic(tmp_path / "t.jsonl")]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "struct.parquet")
    as_text = [r | {"tools": json.dumps(r["tools"])} if "tools" in r else r for r in records]
    pq.write_table(pa.Table.from_pylist(as_text), tmp_path / "text.parquet")
    for name in ("struct", "text"):
        assert [r.messages for r in read_traffic(tmp_path / f"{name}.parquet")] == want


def test_a_null_in_a_logged_tool_schema_is_kept_where_the_log_wrote_it(tmp_path):
    """A JSON schema's `"default": null` is part of the prompt a template writes: a JSONL log, and tools logged as
    JSON text, keep it. A Parquet struct column cannot tell a logged null from the null it fills a missing key
    with, so there nulls are dropped. A call logged with null arguments reads as one with none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    optional = {"unit": {"type": ["string", "null"], "default": None}}
    tool = json.loads(json.dumps(WEATHER))
    tool["function"]["parameters"]["properties"] |= optional
    record = _agent(1) | {"tools": [tool]}
    record["messages"][2]["tool_calls"][0]["function"]["arguments"] = None
    (tmp_path / "t.jsonl").write_text(json.dumps(record) + "\n")
    pq.write_table(pa.Table.from_pylist([record | {"tools": json.dumps([tool])}]), tmp_path / "text.parquet")
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "struct.parquet")
    for name in ("t.jsonl", "text.parquet", "struct.parquet"):
        (req,) = list(read_traffic(tmp_path / name))
        assert isinstance(req, Request), req
        messages, tools = request_from_turns(list(req.messages))
        props = tools[0]["function"]["parameters"]["properties"]
        assert props["unit"] == (optional["unit"] if name != "struct.parquet" else {"type": ["string", "null"]})
        assert messages[2]["tool_calls"][0]["function"].get("arguments") is None
        (call,) = served_messages(messages)[2]["tool_calls"]
        assert call["function"]["arguments"] == {}


def test_tool_traffic_is_sampled_with_its_tools_scrubbed_and_keyed(tmp_path):
    """Requests that differ only in the tools they offer are distinct; the email in a call's arguments is scrubbed
    with the arguments still JSON; every sampled row's key is the one the sampler deduplicated by."""
    records = []
    for i in range(60):
        records.append(_agent(i))
        records.append(_agent(i) | {"tools": [WEATHER]})  # the same conversation, one tool offered
        records.append(_agent(i))  # a repeat: deduplicated
        records.append({"messages": [{"role": "user", "content": f"chat {i} " + tiny.sentences(1, i)[0]}]})
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    arts = sample_traffic(path, tmp_path / "out", SampleConfig(calib_size=120, shadow_size=60))  # all
    rows = split_rows(arts["calib"]) + split_rows(arts["shadow"])
    assert len(rows) == 180
    agents = [r for r in rows if r["route"] == "agent"]
    assert {len(r["tools"]) for r in agents} == {1, 2} and all("tools" not in r for r in rows if r not in agents)
    assert len(agents) == 120  # each conversation twice (two tool sets), never its repeat
    for r in agents:
        (call,) = r["messages"][2]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["notify"] == "<EMAIL>"
        assert "example.com" not in json.dumps(r)
    keys = [row_digest(r) for r in rows]
    assert len(set(keys)) == 180
    assert split_prompts(arts["calib"]) == sorted(keys[:120])
    assert prompt_digest(agents[0]["messages"]) != prompt_digest(agents[0]["messages"], agents[0]["tools"])
    # a row's turns are the record's turns as scrubbed, so its key is the digest the sampler deduplicated by
    read = {tuple(scrub(t)[0] for _, t in r.messages): r for r in read_traffic(path)}
    for r in rows:
        assert tuple(t for _, t in request_turns(r["messages"], r.get("tools"))) in read


def test_a_request_renders_as_vllm_renders_it(tmp_path):
    """The template gets the tools and each call's arguments as an object; a template that writes no tools renders
    the request as it renders the messages alone, which is what that model is served."""
    tok = tiny.make_tokenizer(tmp_path / "tok")
    record = _agent(3)
    messages = record["messages"][:4]
    plain = render(tok, messages, record["tools"])
    assert plain == render(tok, messages) and "get_weather" not in plain
    tok.chat_template = TOOL_TEMPLATE
    text = render(tok, messages, record["tools"])
    assert text.count('"name": "get_weather"') == 1 and '"name": "send_mail"' in text
    assert '<tool_call>get_weather {"city": "city 3", "notify": "jo.bloggs@example.com"}</tool_call>' in text
    assert messages[2]["tool_calls"][0]["function"]["arguments"].startswith('{"city"')  # the row is left as logged
    tok.chat_template = None
    fallback = render(tok, messages, record["tools"])
    assert fallback.startswith('tools: [{"function":{"description"') and '"name":"get_weather"' in fallback


def test_tools_and_calls_are_template_positions_and_turn_texts_are_traffic(tmp_path):
    """What the shadow gate classes as traffic (prompt positions it may gate) and as template: a template writes the
    tools and each call in its own JSON layout, so those tokens are the template's; the user's and the tool's texts
    are traffic."""
    from qgate.chat import encode_with_sources

    tok = tiny.make_tokenizer(tmp_path / "tok")
    tok.chat_template = TOOL_TEMPLATE
    record = _agent(4)
    messages = record["messages"][:4]
    ids, from_traffic, n = encode_with_sources(tok, messages, 10**6, record["tools"])
    assert ids == tok(render(tok, messages, record["tools"]), add_special_tokens=False)["input_ids"] and n == len(ids)
    traffic = tok.decode([i for i, f in zip(ids, from_traffic, strict=True) if f])
    template = tok.decode([i for i, f in zip(ids, from_traffic, strict=True) if not f])
    for text in ("You can call tools.", "what is the weather there", "4 C and dry"):
        assert text in traffic
    for text in ("get_weather", "send_mail", "jo.bloggs@example.com"):
        assert text in template and text not in traffic
