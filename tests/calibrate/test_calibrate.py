import json
import random
import re

import pytest
import tiny

from qgate.artifact import Artifact
from qgate.calibrate.sample import SampleConfig, sample_traffic
from qgate.calibrate.scrub import scrub
from qgate.calibrate.traffic_drift import DriftConfig, traffic_drift
from qgate.errors import ConfigError, InputError

BAD = {
    3: '{"messages": [{"role": "user", "content": "trunc',
    10: '["a", "list"]',
    20: '{"route": "chat"}',
    30: '{"messages": [{"role": "wizard", "content": "hi"}]}',
    40: '{"messages": [{"role": "user", "content": "ok"}], "ts": "yesterday"}',
    50: '{"messages": [{"role": "assistant", "content": "no user turn"}]}',
    60: '{"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, '
    '{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}',
    70: '{"messages": [{"role": "user", "content": [{"image_url": {"url": "https://x/y.png"}}]}]}',
    80: '{"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": null}]}]}',
}


def test_bad_records_are_rejected_with_line_numbers_and_reasons(tmp_path):
    traffic = tiny.make_traffic(tmp_path / "t.jsonl", n=120, bad_lines=BAD)
    arts = sample_traffic(traffic, tmp_path / "out", SampleConfig(calib_size=20, shadow_size=10))
    rejects = [json.loads(x) for x in (tmp_path / "out/rejects.jsonl").read_text().splitlines()]
    assert {r["line"] for r in rejects} == set(BAD)
    by_line = {r["line"]: r["reason"] for r in rejects}
    assert "invalid JSON" in by_line[3]
    assert "not an object" in by_line[10]
    assert "neither 'messages' nor 'prompt'" in by_line[20]
    assert "role 'wizard'" in by_line[30]
    assert "'ts'" in by_line[40]
    assert "no non-empty user message" in by_line[50]
    assert "messages[0].content has a 'image_url' part: qgate scores text" in by_line[60]
    assert "messages[0].content has a part with no type" in by_line[70]
    assert "a refusal part whose 'refusal' is not a string" in by_line[80]
    assert arts["calib"].meta["stats"]["rejected"] == len(BAD)


def test_the_summary_counts_rejects_by_reason_and_names_a_tool_call(tmp_path, capsys):
    """A third of the log is tool-using conversations whose calls name no function: every one is rejected for that,
    and the summary says so above the strata they are missing from."""
    from qgate.cli.main import main

    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}
    records = []
    for i in range(150):
        turns = [{"role": "user", "content": f"question {i} about the weather"}]
        if i % 3 == 0:
            turns += [call, {"role": "tool", "tool_call_id": "c", "content": "12 C"}, turns[0] | {"content": "more"}]
        records.append(json.dumps({"messages": turns, "route": "agent" if i % 3 == 0 else "chat"}))
    records[7] = "{oops"
    (tmp_path / "t.jsonl").write_text("\n".join(records) + "\n")
    argv = ["calibrate", "sample", "--traffic", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "out")]
    assert main([*argv, "--calib-size", "10", "--shadow-size", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"read 150 records: 51 rejected (see {tmp_path / 'out' / 'rejects.jsonl'})")
    assert out[1:3] == [
        "  50 rejected: messages[i].tool_calls[i] has no 'function' with a 'name'",
        "  1 rejected: invalid JSON (unexpected character, expected a string key at column 2)",
    ]
    rejects = [json.loads(x) for x in (tmp_path / "out/rejects.jsonl").read_text().splitlines()]
    assert {r["reason"] for r in rejects if r["line"] == 1} == {
        "messages[1].tool_calls[0] has no 'function' with a 'name'"
    }


def test_traffic_the_sampler_cannot_read_is_drift_though_every_facet_read_stays(tmp_path):
    """A third of the recent log turns to legacy function calls (a `function_call` turn, not read), every one
    rejected: routes, lengths and words of the records read are as before, and the rejected share is what moved."""

    def log(name: str, tools: bool) -> dict:
        lines = []
        for i in range(600):
            turns = [{"role": "user", "content": f"question {i % 97} about the weather and the code"}]
            if tools and i % 3 == 0:
                turns += [{"role": "assistant", "content": None, "function_call": {"name": "f"}}, turns[0]]
            lines.append(json.dumps({"messages": turns, "route": "chat"}))
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        arts = sample_traffic(tmp_path / f"{name}.jsonl", tmp_path / name, SampleConfig(calib_size=10, shadow_size=10))
        return json.loads((arts["profile"].path / "profile.json").read_text())

    before, after = log("before", False), log("after", True)
    rows = {r["facet"]: r for r in traffic_drift(before, after, DriftConfig())}
    assert rows["rejected"]["verdict"] == "drift" and rows["rejected"]["js"] > rows["rejected"]["noise_p99"]
    assert (rows["rejected"]["n_old"], rows["rejected"]["n_new"]) == (600, 600)
    assert rows["rejected"]["top_shifts"] == [  # equal moves, in the categories' order
        {"category": "read", "old": 1.0, "new": pytest.approx(2 / 3)},
        {"category": "rejected", "old": 0.0, "new": pytest.approx(1 / 3)},
    ]
    assert [f for f, r in rows.items() if r["verdict"] == "drift"] == ["rejected"]
    del before["stats"]  # a profile written before profiles kept the sampler's counts: nothing to compare
    old = {r["facet"]: r for r in traffic_drift(before, after, DriftConfig())}["rejected"]
    assert old["verdict"] == "inconclusive" and old["note"].startswith("nothing to compare")


def test_traffic_that_turns_to_tool_use_drifts_on_the_tool_use_facet(tmp_path, capsys):
    """A third of the recent log offers a tool and carries its call and result: the tool-use share moves from 0 to a
    third; a log without tool use records no count (its profile is as before) and compares at 0."""
    from qgate.cli.main import main

    def log(name: str, tools: bool) -> dict:
        lines = []
        for i in range(600):
            record = {"messages": [{"role": "user", "content": f"question {i % 97} about the weather"}]}
            if tools and i % 3 == 0:
                call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                record["messages"] += [
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c", "content": "dry"},
                ]
                record["tools"] = [tiny.WEATHER]
            lines.append(json.dumps(record))
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        out = tmp_path / name
        argv = ["calibrate", "sample", "--traffic", str(tmp_path / f"{name}.jsonl"), "--out", str(out)]
        assert main([*argv, "--calib-size", "10", "--shadow-size", "10"]) == 0
        return json.loads((out / "profile" / "profile.json").read_text())

    before = log("before", False)
    assert "tool_use" not in before["stats"] and "use tools" not in capsys.readouterr().out
    after = log("after", True)
    assert after["stats"]["tool_use"] == 200 and "; 200 read use tools" in capsys.readouterr().out.splitlines()[0]
    rows = {r["facet"]: r for r in traffic_drift(before, after, DriftConfig())}
    tool = rows["tool_use"]
    assert tool["verdict"] == "drift" and (tool["n_old"], tool["n_new"]) == (600, 600)
    assert {s["category"]: (s["old"], s["new"]) for s in tool["top_shifts"]} == {
        "tools": (0.0, pytest.approx(1 / 3)),
        "no tools": (1.0, pytest.approx(2 / 3)),
    }
    assert {r["facet"]: r["verdict"] for r in traffic_drift(before, before, DriftConfig())}["tool_use"] == "ok"


def test_splits_are_disjoint_sized_and_hashed(tmp_path):
    traffic = tiny.make_traffic(tmp_path / "t.jsonl", n=200)
    arts = sample_traffic(traffic, tmp_path / "out", SampleConfig(calib_size=40, shadow_size=25))
    rows = {
        k: [json.loads(x) for x in (arts[k].path / "data.jsonl").read_text().splitlines()] for k in ("calib", "shadow")
    }
    assert len(rows["calib"]) == 40 and len(rows["shadow"]) == 25
    text = {k: {json.dumps(r["messages"]) for r in v} for k, v in rows.items()}
    assert not text["calib"] & text["shadow"]
    for art in arts.values():
        Artifact.load(art.path).verify()
    assert arts["calib"].parents[1] == arts["profile"].sha256
    assert "search" not in arts and not (tmp_path / "out" / "search").exists()


def test_a_search_split_is_a_third_disjoint_split_that_leaves_the_others_alone(tmp_path):
    """search_size draws held-out prompts for `qgate search` from ranks after the shadow and calibration splits': both
    are unchanged by it (a search split changes no calibration, so no quantized variant), and the three splits are
    disjoint, stratified and sized."""
    traffic = tiny.make_traffic(tmp_path / "t.jsonl", n=200)
    two = sample_traffic(traffic, tmp_path / "two", SampleConfig(calib_size=40, shadow_size=25))
    three = sample_traffic(traffic, tmp_path / "three", SampleConfig(calib_size=40, shadow_size=25, search_size=20))
    rows = {
        k: [json.loads(x) for x in (three[k].path / "data.jsonl").read_text().splitlines()]
        for k in ("calib", "shadow", "search")
    }
    assert [len(rows[k]) for k in ("calib", "shadow", "search")] == [40, 25, 20]
    text = {k: {json.dumps(r["messages"]) for r in v} for k, v in rows.items()}
    assert not (text["calib"] & text["shadow"] or text["calib"] & text["search"] or text["shadow"] & text["search"])
    for split in ("shadow", "calib"):
        assert (three[split].path / "data.jsonl").read_bytes() == (two[split].path / "data.jsonl").read_bytes()
    assert three["search"].meta["split"] == "search" and len(three["search"].meta["strata"]) > 1
    with pytest.raises(
        InputError, match=r"calibrate.calib_size \+ calibrate.shadow_size \+ calibrate.search_size = 1065"
    ):
        sample_traffic(traffic, tmp_path / "four", SampleConfig(calib_size=40, shadow_size=25, search_size=1000))


def test_a_shadow_split_passes_over_the_requests_it_is_held_from(tmp_path, capsys):
    """A later window of the same log shares requests with an earlier sample, and with the same seed its shadow split
    draws some of the earlier calibration requests. held_from (a checkpoint's calibration_prompts) keeps them out of
    the shadow split at full size; they stay eligible for calibration, and no held_from changes nothing."""
    from qgate.chat import prompt_digest

    def keys(arts, split):
        return [
            prompt_digest(json.loads(x)["messages"]) for x in (arts[split].path / "data.jsonl").read_text().splitlines()
        ]

    traffic = tiny.make_traffic(tmp_path / "t.jsonl", n=400)
    cfg = SampleConfig(calib_size=40, shadow_size=25, search_size=10)
    before = sample_traffic(traffic, tmp_path / "before", cfg)
    calibrated = set(keys(before, "calib"))
    recent = tmp_path / "recent.jsonl"
    recent.write_text("".join(traffic.read_text().splitlines(True)[200:]))
    plain = sample_traffic(recent, tmp_path / "plain", cfg)
    assert len(calibrated & set(keys(plain, "shadow"))) >= 3  # the overlap the split rule cannot see
    held = sample_traffic(recent, tmp_path / "held", cfg, held_from=tuple(calibrated))
    shadow = keys(held, "shadow")
    assert len(shadow) == 25 and not calibrated & set(shadow)
    assert set(keys(held, "calib")) & calibrated  # still eligible for calibration
    splits = [set(keys(held, k)) for k in ("calib", "shadow", "search")]
    assert sum(map(len, splits)) == len(set().union(*splits)) == 75  # disjoint and sized
    drawn = sum(k in calibrated for k in keys(held, "calib") + keys(held, "search"))
    assert held["shadow"].meta["held_from"] == {"requests": 40, "in_other_splits": drawn} and drawn > 0
    fresh = [k for k in keys(plain, "shadow") if k not in calibrated]
    assert set(fresh) <= set(shadow)  # the shadow split keeps the fresh requests it drew before
    again = sample_traffic(recent, tmp_path / "again", cfg, held_from=())
    for split in ("calib", "shadow", "search"):
        assert (again[split].path / "data.jsonl").read_bytes() == (plain[split].path / "data.jsonl").read_bytes()
    assert "held_from" not in again["shadow"].meta
    from qgate.cli.main import main

    made = tmp_path / "ckpt"
    made.mkdir()
    (made / "config.json").write_text("{}")
    Artifact.create("checkpoint", made, {}, (), {"calibration_sha256": "ab", "calibration_prompts": sorted(calibrated)})
    argv = ["calibrate", "sample", "--traffic", str(recent), "--calib-size", "40", "--shadow-size", "25"]
    argv += ["--search-size", "10", "--held-from", str(made)]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 0
    assert f"passes over the 40 requests --held-from was made with ({drawn} of them" in capsys.readouterr().out
    assert (tmp_path / "cli/shadow/data.jsonl").read_bytes() == (held["shadow"].path / "data.jsonl").read_bytes()
    Artifact.create("checkpoint", made, {}, (), {"calibration_sha256": "ab"})  # quantized before the record
    assert main([*argv, "--out", str(tmp_path / "cli2")]) == 1
    assert "--held-from: this checkpoint records no calibration requests" in capsys.readouterr().err
    assert not (tmp_path / "cli2").exists()


def test_stratified_quota_follows_route_mix(tmp_path):
    lines = []
    for i in range(400):  # 75% chat, 25% code; all short
        route = "code" if i % 4 == 0 else "chat"
        lines.append(json.dumps({"route": route, "prompt": f"request number {i} about {route}"}))
    (tmp_path / "t.jsonl").write_text("\n".join(lines))
    arts = sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=40, shadow_size=20))
    strata = arts["calib"].meta["strata"]
    assert strata == {"chat|0-16": 30, "code|0-16": 10}
    assert arts["shadow"].meta["strata"] == {"chat|0-16": 15, "code|0-16": 5}


def test_same_seed_same_sets_regardless_of_record_order(tmp_path):
    traffic = tiny.make_traffic(tmp_path / "a.jsonl", n=150)
    lines = traffic.read_text().splitlines()
    random.Random(1).shuffle(lines)
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    cfg = SampleConfig(calib_size=30, shadow_size=20, seed=3)
    a = sample_traffic(traffic, tmp_path / "oa", cfg)
    b = sample_traffic(tmp_path / "b.jsonl", tmp_path / "ob", cfg)

    def key(art):
        return sorted(json.dumps(json.loads(x)["messages"]) for x in (art.path / "data.jsonl").read_text().splitlines())

    assert key(a["calib"]) == key(b["calib"]) and key(a["shadow"]) == key(b["shadow"])
    c = sample_traffic(traffic, tmp_path / "oc", SampleConfig(calib_size=30, shadow_size=20, seed=4))
    assert key(c["calib"]) != key(a["calib"])


def test_exact_duplicates_are_dropped(tmp_path):
    rec = json.dumps({"prompt": "the same   question"})
    rec2 = json.dumps({"prompt": "the same question"})  # whitespace-normalized duplicate
    others = [json.dumps({"prompt": f"distinct prompt {i}"}) for i in range(30)]
    (tmp_path / "t.jsonl").write_text("\n".join([rec, rec2, rec] + others))
    arts = sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=20, shadow_size=11))
    assert arts["calib"].meta["stats"]["duplicates"] == 2 and arts["calib"].meta["stats"]["kept"] == 31
    assert arts["calib"].meta["estimates"]["exact"]
    assert arts["profile"].meta["requests"] == 33  # the profile is of the traffic served: repeats included


def test_pii_is_scrubbed_in_written_sets(tmp_path):
    secret = "sk-abcdefghijklmnopqrstuv123456"
    lines = [
        json.dumps({"prompt": f"ticket {i}: mail jane.doe{i}@corp.com or call +1 415-555-01{i:02d}, key {secret}"})
        for i in range(40)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines))
    arts = sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=20, shadow_size=10))
    written = (arts["calib"].path / "data.jsonl").read_text() + (arts["shadow"].path / "data.jsonl").read_text()
    assert "@corp.com" not in written and secret not in written and "555-01" not in written
    assert "<EMAIL>" in written and "<SECRET>" in written and "<PHONE>" in written
    profile = json.loads((arts["profile"].path / "profile.json").read_text())
    assert profile["pii_scrubbed"] == {"email": 40, "secret": 40, "phone": 40}


def test_scrub_keeps_non_pii_numbers():
    text, counts = scrub("order 1234567890123 shipped in 2024, version 1.2.3, card 4111 1111 1111 1111")
    assert "1234567890123" in text and "2024" in text and "1.2.3" in text
    assert "<CARD>" in text and counts == {"card": 1}


def test_parquet_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"parquet prompt {i}", "route": "chat"} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    arts = sample_traffic(tmp_path / "t.parquet", tmp_path / "o", SampleConfig(calib_size=20, shadow_size=10))
    assert arts["calib"].meta["n"] == 20


def test_mostly_garbage_log_is_an_error_not_a_silent_sample(tmp_path):
    (tmp_path / "t.jsonl").write_text("\n".join(["not json"] * 50 + [json.dumps({"prompt": "ok"})]))
    with pytest.raises(InputError, match="records were rejected"):
        sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=1, shadow_size=1))


def test_a_failed_sample_quotes_its_first_rejects_names_the_worst_partitions_and_keeps_every_reject(tmp_path, capsys):
    """`calibrate sample` on a mostly malformed log exits 1 without creating --out: the error quotes the first rejects
    (file:line: reason), names the partitions holding most of them, and keeps rejects.jsonl beside --out; the limit
    is an option, and a run that passes removes the kept file."""
    from qgate.cli.main import main

    good = [json.dumps({"prompt": f"request {i} about topic {i % 5}"}) for i in range(30)]
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_text("\n".join(good[:20] + ['{"msg": 1}'] * 2) + "\n")
    (logs / "b.jsonl").write_text("\n".join(good[20:] + ["not json"] * 30) + "\n")
    (logs / "c.jsonl").write_text("\n".join(['["a", "list"]'] * 5) + "\n")
    out, kept = tmp_path / "out", tmp_path / "out.rejects.jsonl"
    argv = ["calibrate", "sample", "--traffic", str(logs), "--out", str(out), "--calib-size", "5", "--shadow-size", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert (
        f"{logs} (3 files): 37 of 67 records were rejected (55%, more than --max-reject-fraction = 0.5); "
        "most in b.jsonl (30 of 40), c.jsonl (5 of 5), a.jsonl (2 of 22)\n" in err
    ), err
    assert (
        f"broke off (its lines before may be garbage):\n    {logs / 'a.jsonl'}:21: record has neither 'messages' nor "
        "'prompt'\n"
        f"    {logs / 'a.jsonl'}:22: record has neither 'messages' nor 'prompt'\n    {logs / 'b.jsonl'}:11: invalid "
        "JSON" in err
    ), err
    assert f"every reject, with its file, line and reason: {kept}\n" in err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    rejects = [json.loads(r) for r in kept.read_text().splitlines()]
    assert [(r["file"].rsplit("/", 1)[1], r["line"]) for r in rejects] == [("a.jsonl", 21), ("a.jsonl", 22)] + [
        ("b.jsonl", i) for i in range(11, 41)
    ] + [("c.jsonl", i) for i in range(1, 6)]
    assert main(argv + ["--max-reject-fraction", "0.6"]) == 0
    assert not kept.exists() and len((out / "rejects.jsonl").read_text().splitlines()) == 37
    # a gzip partition cut off mid-stream: where it broke is quoted too, though not among the first rejects
    import gzip

    body = gzip.compress(("\n".join(["not json either"] * 40) + "\n").encode())
    (logs / "d.jsonl.gz").write_bytes(body[: len(body) // 2])
    assert main(argv + ["--out", str(tmp_path / "out3")]) == 1
    err = capsys.readouterr().err
    assert re.search(
        rf"\n    {re.escape(str(logs / 'd.jsonl.gz'))}:\d+: compressed stream corrupt or truncated after line \d+", err
    ), err


def test_too_little_traffic_names_the_fix(tmp_path, capsys):
    """Too few prompts names the sizes to lower as the caller sets them: spec paths from the library (a pipeline),
    flags from `qgate calibrate sample`."""
    from qgate.cli.main import main

    tiny.make_traffic(tmp_path / "t.jsonl", n=20)
    with pytest.raises(InputError) as e:
        sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=100, shadow_size=10))
    assert "need calibrate.calib_size + calibrate.shadow_size + calibrate.search_size = 110" in e.value.message
    assert e.value.hint.startswith("lower calibrate.calib_size / calibrate.shadow_size / calibrate.search_size or")
    argv = ["calibrate", "sample", "--traffic", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o2")]
    assert main(argv + ["--calib-size", "100", "--shadow-size", "10"]) == 1
    err = capsys.readouterr().err
    assert "need --calib-size + --shadow-size + --search-size = 110" in err, err
    assert "lower --calib-size / --shadow-size / --search-size or supply more traffic" in err, err


def test_invalid_config():
    from qgate.calibrate.traffic_drift import DriftConfig

    with pytest.raises(ConfigError, match="calib_size"):
        SampleConfig(calib_size=0)
    with pytest.raises(ConfigError, match="^seed must be >= 0, got -1$"):  # numpy refuses negative seeds
        SampleConfig(seed=-1)
    with pytest.raises(ConfigError, match="seed must be >= 0, got -2"):
        DriftConfig(seed=-2)


def test_concurrency_from_latencies(tmp_path):
    # 4 arrivals per second, each lasting 1.5 s: 6 in flight at steady state
    lines = [json.dumps({"prompt": f"p {i}", "ts": i * 0.25, "latency_ms": 1500}) for i in range(200)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines))
    arts = sample_traffic(tmp_path / "t.jsonl", tmp_path / "o", SampleConfig(calib_size=10, shadow_size=10))
    conc = json.loads((arts["profile"].path / "profile.json").read_text())["concurrency"]
    assert conc["method"].startswith("in-flight") and conc["p50"] == 6 and conc["max"] == 6


def _prof(lengths, routes, words, tenants=None):
    n = sum(routes.values())
    return {
        "requests": n,
        "length_words": lengths,
        "routes": routes,
        "tenants": tenants or {"t": n},
        "unigrams": {"total": sum(words.values()), "top": words},
        "stats": {"records": n, "rejected": 0},
    }


def test_drift_detects_route_shift_and_not_proportional_copies():
    base = _prof({"0-16": 500, "16-64": 500}, {"chat": 900, "code": 100}, {"a": 5000, "b": 5000})
    same = _prof({"0-16": 250, "16-64": 250}, {"chat": 450, "code": 50}, {"a": 2500, "b": 2500})
    moved = _prof({"0-16": 500, "16-64": 500}, {"chat": 100, "code": 900}, {"a": 5000, "b": 5000})
    assert all(r["js"] < 1e-9 and r["verdict"] == "ok" for r in traffic_drift(base, same, DriftConfig()))
    rows = {r["facet"]: r for r in traffic_drift(base, moved, DriftConfig())}
    assert rows["route"]["js"] > 0.4 and rows["route"]["verdict"] == "drift" and rows["length"]["verdict"] == "ok"
    assert rows["route"]["top_shifts"][0]["category"] in ("chat", "code")
    # a vocabulary shift cannot be called drift when a profile lacks the split halves that measure its noise
    words_moved = _prof({"0-16": 500, "16-64": 500}, {"chat": 900, "code": 100}, {"a": 9000, "b": 1000})
    vocab = {r["facet"]: r for r in traffic_drift(base, words_moved, DriftConfig())}["vocabulary"]
    assert vocab["js"] > 0.1 and vocab["verdict"] == "inconclusive" and "not measured" in vocab["note"]
    # a shift seen on 5 requests is within sampling noise: inconclusive, not an alarm
    tiny_moved = _prof({"0-16": 3, "16-64": 2}, {"chat": 3, "code": 2}, {"a": 50, "b": 50})
    route = {r["facet"]: r for r in traffic_drift(base, tiny_moved, DriftConfig())}["route"]
    assert route["verdict"] == "inconclusive" and route["js"] > route["threshold"]
    assert route["note"] == "above the limit but within the sampling noise: too little traffic to tell"


def test_drift_cli_exit_codes(tmp_path, capsys):
    from qgate.cli.main import main

    def log(path, routes):
        path.write_text(
            "\n".join(json.dumps({"route": r, "prompt": f"request {i} for {r}"}) for i, r in enumerate(routes))
        )
        return path

    a = log(tmp_path / "a.jsonl", ["chat"] * 90 + ["code"] * 30)
    b = log(tmp_path / "b.jsonl", ["chat"] * 30 + ["code"] * 90)
    for name, traffic in (("a", a), ("b", b), ("a2", a)):
        assert (
            main(
                [
                    "calibrate",
                    "sample",
                    "--traffic",
                    str(traffic),
                    "--out",
                    str(tmp_path / name),
                    "--calib-size",
                    "10",
                    "--shadow-size",
                    "5",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out  # the sampling summary: which counts are estimates; one row per stratum
    assert (
        f"read 120 records: 0 rejected (see {tmp_path / 'a2' / 'rejects.jsonl'}), 0 too short, 0 duplicates "
        "(estimated)\n" in out
    )
    assert (
        "unique prompts: 120, an HLL estimate (120-120 at 2 standard deviations); 2 strata counted by their sketches\n"
        in out
    )
    assert re.search(r"^calib +\S+/a2/calib +10 prompts in 2 strata +sha256 [0-9a-f]{16}$", out, re.M)
    assert re.findall(r"^  (\w+)\|0-16 +(\d+) +(\d+)$", out, re.M)[-2:] == [("chat", "7", "4"), ("code", "3", "1")]
    assert f"picture of the traffic: {tmp_path / 'a2' / 'profile.png'}\n" in out
    png = (tmp_path / "a2" / "profile.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 990  # 11 in at 90 dpi
    assert (
        main(
            [
                "calibrate",
                "sample",
                "--traffic",
                str(a),
                "--out",
                str(tmp_path / "all"),
                "--calib-size",
                "100",
                "--shadow-size",
                "20",
            ]
        )
        == 0
    )  # a sample that holds every prompt: exact counts
    out = capsys.readouterr().out
    assert "0 duplicates\n" in out and "unique prompts: 120\n" in out and "estimate" not in out
    assert (
        main(
            [
                "calibrate",
                "drift",
                "--reference",
                str(tmp_path / "a/profile"),
                "--current",
                str(tmp_path / "a2/profile"),
            ]
        )
        == 0
    )
    assert (
        main(
            ["calibrate", "drift", "--reference", str(tmp_path / "a/profile"), "--current", str(tmp_path / "b/profile")]
        )
        == 3
    )
    assert "route      JS" in capsys.readouterr().out
    assert (
        main(["calibrate", "drift", "--reference", str(tmp_path / "a/calib"), "--current", str(tmp_path / "b/profile")])
        == 1
    )


def test_pii_recall_and_precision_per_type_on_the_labeled_set():
    """data/pii/labeled.jsonl: real demo prompts with injected PII of every type and hard negatives (bench_pii.py)."""
    from pathlib import Path

    from qgate.calibrate.scrub_eval import demo_prompts, load_labeled, score

    s = score(load_labeled(Path(__file__).parents[2] / "data/pii/labeled.jsonl"), demo_prompts())
    assert s["rows"] >= 2000 and s["negative_rows"] >= 500
    for kind, v in s["types"].items():
        assert v["injected"] >= 300, kind
        assert v["recall"] >= 0.99, (kind, v)
        assert v["precision"] >= 0.95, (kind, v)


@pytest.mark.parametrize(
    "text,kind",
    [
        ("call +44 20 7946 0958 today", "phone"),
        ("ring (415) 555-0132 or", "phone"),
        ("tel 01 42 68 53 00 merci", "phone"),
        ("IBAN DE89 3704 0044 0532 0130 00 I sent", "iban"),
        ("ssn 123-45-6789", "national_id"),
        ("NI AB 12 34 56 C", "national_id"),
        ("host 2001:db8::8a2e:370:7334 down", "ip"),
        ("token ghp_" + "a" * 36, "secret"),
        ("amex 3782 822463 10005", "card"),
    ],
)
def test_scrub_finds_each_type(text, kind):
    clean, counts = scrub(text)
    assert counts == {kind: 1}, (clean, counts)


@pytest.mark.parametrize(
    "text",
    [
        "order #7758975076",
        "1 2 3 4 5 6 7 8 9 10",
        "v1.2.3.4",
        "ISBN 978-0-306-40615-7",
        "at 12:30:45",
        "id 8f544299-1718-441e-a84f-4bb285c34c0e",
        "invoice 4484363313638",
        "price $80628.45",
        "2024-01-15",
    ],
)
def test_scrub_leaves_look_alikes(text):
    assert scrub(text) == (text, {})


def test_scrub_prefilters_never_change_the_result():
    """The cheap preconditions (a digit, "@", ":", a secret's literal prefix) only skip rules that cannot match: on
    the labeled set, on its texts cut at random and glued together, and with secrets in mixed case, scrubbing with
    and without them gives the same text and counts."""
    from pathlib import Path

    rows = [
        json.loads(line)["text"]
        for line in (Path(__file__).parents[2] / "data/pii/labeled.jsonl").read_text().splitlines()
    ]
    rng = random.Random(7)
    texts = rows + ["Authorization: BeArEr " + "x" * 24, "-----BEGIN PRIVATE KEY-----\nabc\n-----END PRIVATE KEY-----"]
    for _ in range(2000):
        a, b = rng.choice(rows), rng.choice(rows)
        texts.append(a[rng.randint(0, len(a)) :] + rng.choice(("", " ", "\n", ":", "@")) + b[: rng.randint(0, len(b))])
    skipped = 0
    for t in texts:
        assert scrub(t) == scrub(t, prefilter=False), t
        skipped += not any(ch.isdigit() for ch in t)
    assert skipped > 100  # the digit precondition was exercised, not only texts that run every rule


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_a_decompression_bomb_is_refused_after_a_bounded_read(tmp_path, suffix, monkeypatch):
    """Real records, then a stream of zeros that inflates ~1,000x: the records are kept and the stream is refused as
    a bomb once it has inflated past the floor, long before its end, by both readers (records and sampling blocks)."""
    import gzip

    from backports.zstd import ZstdFile

    from qgate.calibrate import reader, streams
    from qgate.calibrate.batches import read_units
    from qgate.calibrate.sources import list_partitions

    monkeypatch.setattr(streams, "INFLATION_FLOOR", 8 << 20)  # the same check at a test's size
    lines = tiny.make_traffic(tmp_path / "t.jsonl", n=20).read_bytes()
    bomb = tmp_path / f"bomb.jsonl{suffix}"
    with gzip.open(bomb, "wb", 9) if suffix == ".gz" else ZstdFile(bomb, "wb", level=19) as f:
        f.write(lines)
        for _ in range(64):  # 64 MiB of zeros: one line the line limit skips unread, inflated at ~1,000x
            f.write(bytes(1 << 20))
    assert bomb.stat().st_size < (64 << 20) / 500
    items = list(reader.read_traffic(bomb))
    assert sum(isinstance(i, reader.Request) for i in items) == 20
    assert "decompression bomb, refused" in items[-1].reason and reader.STREAM_BROKE in items[-1].reason
    units = list(read_units(list_partitions(bomb)[0], reader.MAX_LINE_BYTES))
    assert units[-1][0] == "items" and "decompression bomb" in units[-1][2][0].reason
    monkeypatch.setattr(streams, "INFLATION_FLOOR", 1 << 20)
    many = tiny.make_traffic(tmp_path / "many.jsonl", n=20000).read_bytes()  # distinct records, past the floor
    ordinary = tmp_path / f"many.jsonl{suffix}"
    with gzip.open(ordinary, "wb", 9) if suffix == ".gz" else ZstdFile(ordinary, "wb", level=19) as f:
        f.write(many)
    assert len(many) > 2 << 20 and sum(isinstance(i, reader.Request) for i in reader.read_traffic(ordinary)) == 20000


def test_text_like_content_parts_are_joined_as_vllm_joins_them():
    """vLLM hands a text chat template a message's plain-string, text, input_text and refusal parts joined by
    newlines; the reader reads them so, and the request is kept."""
    from qgate.calibrate.reader import Request, parse_record

    parts = ["plain", {"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    history = [{"type": "refusal", "refusal": "no"}]
    obj = {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": history},
            {"role": "user", "content": [{"type": "text", "text": "again"}]},
        ]
    }
    r = parse_record(1, obj, b"")
    assert isinstance(r, Request)
    assert r.messages == (("user", "plain\na\nb"), ("assistant", "no"), ("user", "again"))
