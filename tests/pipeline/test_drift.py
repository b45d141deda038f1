"""The drift job: traffic and quality drift, the scheduled run, its lock, and re-runs after a kill."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny
from specs import AWQ, LENIENT, SHIFT, STRICT, W8, drift_spec, mlflow_client, model_alias

from qgate.calibrate.profile import TrafficProfiler, words
from qgate.calibrate.traffic_drift import DriftConfig, traffic_drift
from qgate.cli.main import main


def _profile(path):
    prof = TrafficProfiler()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        prof.add(r["route"], r["tenant"], words(r["messages"][-1]["content"]), None, None)
    return prof.result()


def test_no_false_alarms_on_fresh_samples_of_the_same_traffic_and_drift_on_a_shifted_log(tmp_path):
    ref = _profile(tiny.make_traffic(tmp_path / "ref.jsonl", n=600, seed=100))
    alarms = []
    for seed in range(20):  # 20 fresh samples from the same traffic: at most one false alarm
        rows = traffic_drift(
            ref, _profile(tiny.make_traffic(tmp_path / f"s{seed}.jsonl", n=600, seed=seed)), DriftConfig()
        )
        alarms.append([r["facet"] for r in rows if r["verdict"] == "drift"])
    assert sum(bool(a) for a in alarms) <= 1, alarms
    rows = {
        r["facet"]: r
        for r in traffic_drift(
            ref, _profile(tiny.make_traffic(tmp_path / "x.jsonl", n=600, seed=1, **SHIFT)), DriftConfig()
        )
    }
    assert {f for f, r in rows.items() if r["verdict"] == "drift"} == {"length", "route", "tenant"}
    assert (
        rows["route"]["js"] > rows["route"]["noise_p99"] and rows["route"]["top_shifts"][0]["category"] == "code-assist"
    )


def test_real_demo_traffic_halves_do_not_alarm_and_the_shifted_demo_log_does(tmp_path):
    """The same on real ShareGPT prompts, whose words co-vary within a request: 20 random halves of the demo log
    against each other, then the demo log against the drifted one."""
    import random
    from pathlib import Path

    from qgate.calibrate.sample import SampleConfig, sample_traffic

    demo = Path(__file__).resolve().parents[2] / "data" / "demo"
    cfg = SampleConfig(calib_size=8, shadow_size=8)

    def profile(lines_or_path, name):
        path = lines_or_path if isinstance(lines_or_path, Path) else tmp_path / f"{name}.jsonl"
        if not isinstance(lines_or_path, Path):
            path.write_text("\n".join(lines_or_path) + "\n")
        return json.loads((sample_traffic(path, tmp_path / name, cfg)["profile"].path / "profile.json").read_text())

    lines = (demo / "traffic.jsonl").read_text().splitlines()
    alarms, vocab = 0, []
    for seed in range(20):
        random.Random(seed).shuffle(lines)
        rows = traffic_drift(profile(lines[:800], "h1"), profile(lines[800:], "h2"), DriftConfig())
        alarms += any(r["verdict"] == "drift" for r in rows)
        vocab.append(next(r for r in rows if r["facet"] == "vocabulary"))
    assert alarms <= 1
    assert all(v["noise_p99"] > v["js"] for v in vocab)  # the measured split-half noise covers what halves really show
    rows = {
        r["facet"]: r
        for r in traffic_drift(
            profile(demo / "traffic.jsonl", "base"), profile(demo / "traffic-shifted.jsonl", "moved"), DriftConfig()
        )
    }
    assert rows["route"]["verdict"] == "drift" and rows["tenant"]["verdict"] == "drift"
    assert rows["route"]["top_shifts"][0]["category"] in ("chat", "code-assist")


def test_traffic_can_be_a_directory_of_partitions_or_a_glob(tmp_path):
    from qgate.calibrate.sample import SampleConfig, sample_traffic

    whole = tiny.make_traffic(tmp_path / "whole.jsonl", n=200, seed=3)
    lines = whole.read_text().splitlines(keepends=True)
    parts = tmp_path / "parts" / "day=2026-11-21"
    parts.mkdir(parents=True)
    (parts / "a.jsonl").write_text("".join(lines[:120]))
    (parts / "b.jsonl").write_text("".join(lines[120:]) + "{oops\n")
    cfg = SampleConfig(calib_size=20, shadow_size=10)
    a = sample_traffic(tmp_path / "parts", tmp_path / "o1", cfg)
    b = sample_traffic(f"{tmp_path}/parts/*/*.jsonl", tmp_path / "o2", cfg)
    assert a["calib"].meta["stats"]["records"] == 201 and a["calib"].meta["stats"]["rejected"] == 1
    assert a["calib"].sha256 == b["calib"].sha256 and a["profile"].meta["requests"] == 200
    rej = json.loads((tmp_path / "o1/rejects.jsonl").read_text())
    assert rej["file"].endswith("b.jsonl") and rej["line"] == 81
    assert main(["calibrate", "sample", "--traffic", f"{tmp_path}/nothing/*.jsonl", "--out", str(tmp_path / "o3")]) == 1


def test_a_drift_job_without_its_store_names_the_spec_key_before_reading_traffic(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = str(drift_spec(tmp_path, tmp_path / "no-model", [W8], STRICT))
    for job in ("check", "run"):
        assert main(["drift", job, "--spec", spec, "--traffic", str(tmp_path / "missing.jsonl")]) == 1
        err = capsys.readouterr().err  # the store, not the traffic: a cron job's recent log may be large
        assert f"error: no MLflow store at {tmp_path / 'mlflow'} (searched registry.store in the spec)\n" in err
        assert "hint: set registry.store in the spec to the store `qgate run` registered into" in err
    assert not (tmp_path / "mlflow").exists()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, workdir):
    """A store where production is w8, gated and calibrated on the original traffic; plus a snapshot to restore."""
    src = workdir / "tiny-src"
    if not src.exists():
        tiny.make_model(src)
    root = tmp_path_factory.mktemp("drift")
    tiny.make_traffic(root / "traffic.jsonl", n=300, seed=0)
    tiny.make_traffic(root / "same.jsonl", n=300, seed=11)  # the same traffic, sampled again
    tiny.make_traffic(root / "shifted.jsonl", n=300, seed=12, **SHIFT)
    spec = drift_spec(root, src, [W8], STRICT, {"auto_promote": True})
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    assert main(["run", str(spec)]) == 0
    snap = root.parent / (root.name + "-snapshot")
    shutil.copytree(root, snap)
    return root, snap, src


@pytest.fixture
def fresh(deployed, tmp_path):
    """A private copy of the deployed state (paths inside it are relative, so the copy is self-contained)."""
    _, snap, src = deployed
    root = tmp_path / "d"
    shutil.copytree(snap, root)
    return root, src


def test_registered_version_carries_its_calibration_profile_and_recipe(fresh):
    root, _ = fresh
    tags = mlflow_client(root).get_model_version("tiny-llm", model_alias(root)).tags
    assert json.loads(tags["qgate.recipe"]) == {
        "scheme": "gptq-w8a16",
        "options": {"group_size": 32},
        "kv_cache": None,
        "engine": None,
    }
    from qgate.artifact import Artifact

    assert tags["qgate.profile_sha256"] == Artifact.load(root / "work/calib/profile").sha256
    assert tags["qgate.profile_artifact"].endswith("/traffic-profile")


def test_a_check_with_facets_that_could_not_tell_says_so_beside_its_verdict():
    """An inconclusive traffic facet is not drift, and not shown ok either: the console line and the report's "why"
    name it, where they used to say NO-DRIFT and "nothing moved"."""
    from qgate.cli.drift import _verdict
    from qgate.pipeline.drift_report import _why

    clear = {"verdict": "no-drift", "reasons": [], "inconclusive": []}
    assert _verdict(clear) == "NO-DRIFT"
    assert _why(clear) == "no facet moved beyond its limit and above the sampling noise"
    unsure = clear | {"inconclusive": ["route", "vocabulary"]}
    assert _verdict(unsure) == "NO-DRIFT (inconclusive: route, vocabulary)"
    assert _why(unsure).endswith("; inconclusive, so not shown ok: route, vocabulary (see their notes above)")
    moved = {"verdict": "drift", "reasons": ["tenant moved (JS 0.325 > 0.05)"], "inconclusive": ["route"]}
    assert _verdict(moved) == "DRIFT (inconclusive: route)" and _why(moved).startswith("tenant moved (JS 0.325")


def test_drift_check_exit_codes_reports_and_registry_tags(fresh, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    spec = str(root / "spec.yaml")
    assert main(["drift", "check", "--spec", spec, "--traffic", str(root / "same.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "quality kl_mean" in err and "NO-DRIFT" in err
    assert (
        len(
            re.findall(
                r"quality caveat: \d+ of \d+ shadow prompts are longer than gates.shadow.max_prompt_tokens \(48;", err
            )
        )
        == 1
    )
    assert main(["drift", "check", "--spec", spec, "--traffic", str(root / "shifted.jsonl")]) == 3
    out = capsys.readouterr()
    assert "drift check: DRIFT" in out.out and "route moved" in out.err
    report_path = out.out.split("report ")[-1].strip()
    report = json.loads(
        (root / "work/drift").joinpath(report_path.split("/drift/")[1]).with_name("drift.json").read_text()
    )
    assert report["verdict"] == "drift" and {r["facet"] for r in report["traffic"] if r["verdict"] == "drift"} >= {
        "route",
        "length",
    }
    unsure = [r["facet"] for r in report["traffic"] if r["verdict"] == "inconclusive"]
    assert report["inconclusive"] == unsure and ("(inconclusive: " in out.out) == bool(unsure), (unsure, out.out)
    assert report["quality"]["gated"]["kl_mean"] >= 0 and "<img" in open(report_path).read()
    cut = report["quality"]["scoring"]["prompts_cut"]
    assert cut > 0 and f"<b>Caveat</b>: {cut} of " in open(report_path).read()
    assert "were scored on their last 48 tokens" in open(report_path).read()
    tags = mlflow_client(root).get_model_version("tiny-llm", model_alias(root)).tags
    assert tags["qgate.drift.verdict"] == "drift" and tags["qgate.drift.report_artifact"].startswith("runs:/")
    assert main(["drift", "check", "--spec", spec, "--traffic", str(root / "missing.jsonl")]) == 1
    assert "traffic log not found" in capsys.readouterr().err


def test_a_drift_check_reads_the_recent_log_twice_and_every_engine_gives_one_report(
    fresh, monkeypatch, tmp_path, partition_opens
):
    """The job hashes the recent traffic once (its workdir and the calibrate stage's key) and scans it once: on object
    storage every extra pass is a download of the whole log. `--executor processes` gives the serial check's report."""
    from collections import Counter
    from pathlib import Path

    from qgate.pipeline.drift_jobs import drift_check
    from qgate.pipeline.spec import load_spec

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    twin = tmp_path / "twin"
    shutil.copytree(root, twin)  # the same deployed state, checked with the processes engine
    serial = drift_check(load_spec(root / "spec.yaml"), str(root / "shifted.jsonl"), echo=lambda m: None, record=False)
    assert partition_opens == Counter({"shifted.jsonl": 2}), partition_opens
    again = drift_check(load_spec(root / "spec.yaml"), str(root / "shifted.jsonl"), echo=lambda m: None, record=False)
    assert partition_opens == Counter({"shifted.jsonl": 2}), partition_opens  # hashed from its cached scan: not read
    assert again["recent"] == serial["recent"] and again["traffic"] == serial["traffic"]
    assert len(list((root / "work/drift/scans").glob("scan-*.json"))) == 1  # kept for the next window that holds it
    assert (
        main(
            [
                "drift",
                "check",
                "--spec",
                str(twin / "spec.yaml"),
                "--traffic",
                str(twin / "shifted.jsonl"),
                "--no-record",
                "--executor",
                "processes",
            ]
        )
        == 3
    )
    report = json.loads(next((twin / "work/drift").glob("*/report/drift.json")).read_text())
    assert serial["verdict"] == report["verdict"] == "drift"
    assert [(r["facet"], r["js"], r["verdict"]) for r in serial["traffic"]] == [
        (r["facet"], r["js"], r["verdict"]) for r in report["traffic"]
    ]
    assert serial["recent"]["shadow_sha256"] == report["recent"]["shadow_sha256"]

    def profile(rep):  # the same profile but for its source's path (the twin lives elsewhere)
        return {
            k: v
            for k, v in json.loads((Path(rep["recent"]["workdir"]) / "calib/profile/profile.json").read_text()).items()
            if k != "source"
        }

    assert profile(serial) == profile(report)
    assert (
        main(
            [
                "drift",
                "check",
                "--spec",
                str(twin / "spec.yaml"),
                "--traffic",
                str(twin / "shifted.jsonl"),
                "--engine",
                "spark",
            ]
        )
        == 1
    )


def test_a_later_window_of_the_same_log_regates_production_on_requests_it_was_not_calibrated_on(
    fresh, monkeypatch, capsys
):
    """The last half of the log production was sampled from repeats requests it was calibrated on, and a plain sample
    of it puts some in the shadow split. The drift job's sample passes over them: production is re-gated on 48
    requests none of which it was calibrated on, and the gate has none to leave out."""
    from qgate.artifact import Artifact
    from qgate.calibrate.sample import SampleConfig, sample_traffic
    from qgate.chat import prompt_digest

    def keys(split):
        return {prompt_digest(json.loads(x)["messages"]) for x in (split / "data.jsonl").read_text().splitlines()}

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    calibrated = keys(root / "work/calib/calib")
    window = root / "window.jsonl"
    window.write_text("".join((root / "traffic.jsonl").read_text().splitlines(True)[150:]))
    plain = sample_traffic(window, root / "plain", SampleConfig(calib_size=24, shadow_size=48))
    assert len(keys(plain["shadow"].path) & calibrated) >= 3  # what the job would have scored production on
    assert main(["drift", "check", "--spec", str(root / "spec.yaml"), "--traffic", str(window)]) == 0
    err = capsys.readouterr().err
    assert f"its shadow split passes over the {len(calibrated)} requests production was made with" in err
    (path,) = (root / "work/drift").glob("*/report/drift.json")
    report = json.loads(path.read_text())
    shadow = Artifact.load(Path(report["recent"]["workdir"]) / "calib/shadow")
    assert shadow.sha256 == report["recent"]["shadow_sha256"] and shadow.meta["n"] == 48
    assert not keys(shadow.path) & calibrated
    assert report["quality"]["scoring"]["fitted_prompts_excluded"] == 0 and not report["quality"]["notes"]
    assert report["recent"]["shadow_held_from"] == shadow.meta["held_from"]
    html = path.with_name("drift.html").read_text()
    assert f"passing over the {len(calibrated)} requests production was made with" in html


def test_quality_drift_when_production_points_at_a_worse_version(fresh, monkeypatch, capsys):
    """awq passes a lenient gate and is promoted by hand; on the same traffic, the spec's real gate fails it: quality
    drift alone, no traffic drift. A drift run then finds no recalibrated variant that passes and leaves production
    alone."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, src = fresh
    lenient = drift_spec(root, src, [AWQ], LENIENT, name="lenient.yaml")
    assert main(["run", str(lenient)]) == 0
    awq_version = model_alias(root)
    assert mlflow_client(root).get_model_version("tiny-llm", awq_version).tags["qgate.variant"] == "awq"
    strict_awq = drift_spec(root, src, [AWQ], STRICT, {"auto_promote": True}, name="strict-awq.yaml")
    assert main(["drift", "check", "--spec", str(strict_awq), "--traffic", str(root / "same.jsonl")]) == 3
    err = capsys.readouterr().err
    assert "production's shadow gate is FAIL" in err and "route moved" not in err
    n_before = len(mlflow_client(root).search_model_versions("name='tiny-llm'"))
    assert main(["drift", "run", "--spec", str(strict_awq), "--traffic", str(root / "same.jsonl")]) == 2
    assert "no recalibrated variant passed" in capsys.readouterr().err
    assert model_alias(root) == awq_version  # production left alone
    assert (
        len(mlflow_client(root).search_model_versions("name='tiny-llm'")) == n_before + 1
    )  # awq recalibrated, registered, refused


def test_drift_run_recalibrates_promotes_and_a_rerun_does_nothing(fresh, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    spec = str(root / "spec.yaml")
    old = model_alias(root)
    assert main(["drift", "run", "--spec", spec, "--traffic", str(root / "shifted.jsonl")]) == 0
    out = capsys.readouterr().out
    new = model_alias(root)
    assert new != old and model_alias(root, "previous-production") == old and f"v{new} @production" in out
    tags = mlflow_client(root).get_model_version("tiny-llm", new).tags
    shifted_profile = json.loads((next((root / "work/drift").glob("*/calib/profile/profile.json"))).read_text())
    assert (
        shifted_profile["routes"]["code-assist"] > 150
        and tags["qgate.profile_sha256"]
        != mlflow_client(root).get_model_version("tiny-llm", old).tags["qgate.profile_sha256"]
    )
    n = len(mlflow_client(root).search_model_versions("name='tiny-llm'"))
    assert main(["drift", "run", "--spec", spec, "--traffic", str(root / "shifted.jsonl")]) == 0  # production now fits
    assert (
        "NO-DRIFT" in capsys.readouterr().err and len(mlflow_client(root).search_model_versions("name='tiny-llm'")) == n
    )


def test_drift_run_without_auto_promote_registers_and_exits_3(fresh, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, src = fresh
    spec = drift_spec(root, src, [W8], STRICT, {"auto_promote": False}, name="manual.yaml")
    old = model_alias(root)
    assert main(["drift", "run", "--spec", str(spec), "--traffic", str(root / "shifted.jsonl")]) == 3
    out = capsys.readouterr().out
    assert "awaits promotion" in out and model_alias(root) == old


class Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so nothing in qgate catches it."""


@pytest.mark.parametrize("where", ["calibrate", "quantize", "gate", "register", "register-recorded", "promote"])
def test_drift_run_killed_at_each_step_reruns_without_duplicates(fresh, monkeypatch, where):
    import qgate.pipeline.drift_jobs as drift_mod
    import qgate.pipeline.ledger as ledger_mod
    import qgate.registry.mlflow_store as store_mod

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    spec = str(root / "spec.yaml")
    old = model_alias(root)

    def after(mod, name, when=lambda *a, **k: True):
        real = getattr(mod, name)

        def wrapped(*a, **k):
            out = real(*a, **k)
            if when(*a, **k):
                raise Killed(name)
            return out

        monkeypatch.setattr(mod, name, wrapped)

    if where == "calibrate":
        after(drift_mod, "calibrate_stage")
    elif where in ("quantize", "gate"):
        real_run = ledger_mod.Ledger.run

        def run(self, name, key, out, fn):
            art = real_run(self, name, key, out, fn)
            if name.startswith(where + ":"):
                raise Killed(name)
            return art

        monkeypatch.setattr(ledger_mod.Ledger, "run", run)
    elif where == "register":  # the version exists in the registry, the ledger does not know it
        after(store_mod, "register")
    elif where == "register-recorded":
        after(drift_mod, "register_stage")
    else:
        after(store_mod, "promote")
    with pytest.raises(Killed):
        from qgate.pipeline.drift_jobs import drift_run
        from qgate.pipeline.spec import load_spec

        drift_run(load_spec(root / "spec.yaml"), str(root / "shifted.jsonl"), echo=lambda m: None)
    monkeypatch.undo()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["drift", "run", "--spec", spec, "--traffic", str(root / "shifted.jsonl")]) == 0
    versions = mlflow_client(root).search_model_versions("name='tiny-llm'")
    assert len(versions) == 2, [v.version for v in versions]  # the deployed w8 and one recalibrated w8
    assert model_alias(root) != old and model_alias(root, "previous-production") == old
    assert not list((root / "mlflow" / "locks").glob("*.owner.json"))  # the lock's owner record is cleaned up


HOLD = """
import sys, time
from pathlib import Path
from qgate.locks import job_lock
with job_lock(Path(sys.argv[1]), "holder"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_one_drift_run_per_model_and_a_killed_holder_is_taken_over(fresh, monkeypatch, capsys):
    from qgate.errors import LockHeld
    from qgate.locks import job_lock

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    lock = root / "mlflow" / "locks" / "drift-tiny-llm.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["drift", "run", "--spec", str(root / "spec.yaml"), "--traffic", str(root / "shifted.jsonl")]) == 1
        err = capsys.readouterr().err
        assert "the lock is held (holder: " in err and f"pid {holder.pid}" in err
        t = time.perf_counter()
        with pytest.raises(LockHeld):
            with job_lock(lock, "second", wait=0.5):
                pass
        assert time.perf_counter() - t >= 0.5
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    seen = []
    with job_lock(lock, "after the kill", echo=seen.append) as me:
        assert me["stale_taken_over"]["pid"] == holder.pid
    assert "stale lock" in seen[0] and f"pid {holder.pid}" in seen[0]
    assert not lock.with_name(lock.name + ".owner.json").exists()
    with pytest.raises(ValueError), job_lock(lock, "a job that fails"):
        raise ValueError("an error, not a kill")
    seen.clear()
    with job_lock(lock, "after the failure", echo=seen.append) as me:  # not reported as a stale lock
        assert me["stale_taken_over"] is None and seen == []


def test_drift_policy_keys_are_strict(fresh):
    from qgate.errors import ConfigError
    from qgate.pipeline.spec import load_spec

    root, src = fresh
    bad = drift_spec(root, src, [W8], STRICT, {"max_js_rout": 0.1}, name="bad.yaml")
    with pytest.raises(ConfigError, match=r"drift.max_js_rout: unknown key; did you mean 'max_js_route'"):
        load_spec(bad)
    bad = drift_spec(root, src, [W8], STRICT, {"max_js_route": 2}, name="bad2.yaml")
    with pytest.raises(ConfigError, match=r"drift\.max_js_route must be in \(0, 1\] bits, got 2"):
        load_spec(bad)


MARKUP = ("$\\frac{$", "<script>alert(1)</script>", "![x](http://evil.example/x.png)")


def test_traffic_text_with_markup_stays_inert_in_pictures_and_reports(fresh, monkeypatch, capsys):
    """Tenants named, and prompts ending in, TeX that matplotlib would parse (and fail on), a script tag and a remote
    Markdown image: the calibration picture and the drift check's picture are made, and the drift report's page holds
    none of it as markup."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root, _ = fresh
    log = tiny.make_traffic(root / "markup.jsonl", n=300, seed=13, tenants=MARKUP)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for i, r in enumerate(records):
        r["messages"][-1]["content"] += " " + MARKUP[i % len(MARKUP)]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "markup-calib"
    assert main(["calibrate", "sample", "--traffic", str(log), "--out", str(out), "--calib-size", "32"]) == 0
    assert (out / "profile.png").stat().st_size > 1000
    capsys.readouterr()
    assert main(["drift", "check", "--spec", str(root / "spec.yaml"), "--traffic", str(log)]) == 3  # tenants moved
    printed = capsys.readouterr()
    page = open(printed.out.split("report ")[-1].strip()).read()
    assert "tenant" in page and "<img" in page
    assert "tenant moved" in page and "<script>" not in page  # tenants are drawn in the picture, never as markup
    assert 'src="http' not in page  # a Markdown image in traffic is not an image in the report
