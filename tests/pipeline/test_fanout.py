"""The pipeline's variant fan-out on Ray: the same results as a serial run, failures that keep finished stages, and
resources no node can hold refused before any work."""

import json

import pytest
from specs import pipeline_spec
from traffic_gen import make_records, write_parts

from qgate.errors import ConfigError, InputError, QgateError


def test_variants_fanned_out_on_ray_match_the_serial_run(tmp_path, workdir, monkeypatch):
    """`qgate run --executor ray`: the variants' chains run as Ray tasks with their declared resources; the
    baseline caches are computed once before the fan-out; calibration sets, checkpoints, engines and every check's
    verdict and observation equal the serial run's, and the driver alone writes the ledger."""
    import yaml

    from qgate.cli.main import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs = {}
    for mode in ("serial", "ray"):
        d = tmp_path / mode
        d.mkdir()
        spec = pipeline_spec(d, workdir)
        data = yaml.safe_load(spec.read_text())
        for v in data["variants"]:
            v["resources"] = {"num_cpus": 1}
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        assert main(["run", str(spec), "--executor", mode]) == 0
        runs[mode] = d / "work"
    ledgers = {m: json.loads((w / "stages.json").read_text()) for m, w in runs.items()}
    assert set(ledgers["ray"]) == set(ledgers["serial"])
    for name in ledgers["serial"]:
        if name.startswith(("model", "calibrate", "quantize:", "engine:")):
            assert ledgers["ray"][name]["sha256"] == ledgers["serial"][name]["sha256"], name
    reports = {
        m: {v: json.loads((w / "variants" / v / "gate" / "report.json").read_text()) for v in ("awq-cpu", "w8")}
        for m, w in runs.items()
    }
    for v in ("awq-cpu", "w8"):
        a, b = reports["serial"][v], reports["ray"][v]
        assert a["verdict"] == b["verdict"]
        assert [(r["gate"], r["metric"], r["verdict"], r["observed"]) for r in a["results"] if r["gate"] != "perf"] == [
            (r["gate"], r["metric"], r["verdict"], r["observed"]) for r in b["results"] if r["gate"] != "perf"
        ]
    summary = json.loads((runs["ray"] / "summary.json").read_text())
    assert summary["promoted"]["variant"] == "w8"
    assert main(["run", str(tmp_path / "ray" / "spec.yaml"), "--parallel", "ray"]) == 0  # re-run: every stage skipped
    assert json.loads((runs["ray"] / "summary.json").read_text())["stages_run"] == []


def test_a_pipeline_samples_exactly_the_partitions_its_stage_key_hashed(tmp_path, workdir, monkeypatch):
    """The calibrate stage lists its traffic once: a partition that lands after the stage key was hashed (a live log
    directory or bucket) is not sampled under that key, so the artifacts' source hash is the key's traffic hash (a
    second listing keyed one set of partitions and sampled another)."""

    from qgate.pipeline import stages
    from qgate.pipeline.ledger import Ledger
    from qgate.pipeline.spec import load_spec

    logs = write_parts(tmp_path / "logs", make_records(300, seed=5), [150])
    spec = load_spec(pipeline_spec(tmp_path, workdir, traffic="logs"))
    real, keyed = stages.traffic_key, []

    def then_a_file_lands(*a, **k):
        keyed.append(real(*a, **k))
        (logs / "part-late.jsonl").write_bytes(b"\n".join(make_records(40, seed=6)) + b"\n")
        return keyed[-1]

    monkeypatch.setattr(stages, "traffic_key", then_a_file_lands)
    profile = stages.calibrate_stage(
        Ledger(spec.path(spec.workdir), lambda m: None), spec, spec.traffic_source()
    ).profile
    assert profile.parents[0] == keyed[0] and profile.meta["requests"] <= 300


def test_a_variant_no_ray_node_can_hold_is_refused_before_any_work(tmp_path, workdir, monkeypatch):
    """A variant asking for a GPU on a local Ray instance without one would wait forever (Ray only logs that the
    task cannot be scheduled): the run refuses it before the model import, naming the key and what the node has. On
    a cluster (RAY_ADDRESS), where an autoscaler may add such a node, it says what the task waits for instead."""
    import yaml

    from qgate.pipeline import jobs
    from qgate.pipeline.jobs import placeable, run_pipeline
    from qgate.pipeline.spec import load_spec

    path = pipeline_spec(tmp_path, workdir)
    data = yaml.safe_load(path.read_text())
    data["variants"][1]["resources"] = {"num_gpus": 1}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    spec = load_spec(path)
    monkeypatch.setattr(jobs, "_run", lambda *a, **k: pytest.fail("the run started: it would wait forever"))
    with pytest.raises(
        ConfigError,
        match=r"variants\[1\]\.resources: variant w8 asks one node for CPU 1, GPU 1; the largest "
        r"node of this Ray instance has CPU \d+, memory [\d.]+ GiB, so its task would wait forever",
    ):
        run_pipeline(spec, echo=lambda m: None, executor="ray")
    assert not (tmp_path / "work").exists()  # refused before anything was made
    said: list[str] = []
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # the same nodes, as a cluster's: a warning
    placeable(spec.variants, said.append)  # (the first variant asks for nothing: it fits)
    assert (
        len(said) == 1
        and said[0].startswith("  ! variants[1].resources: variant w8 asks one node for CPU 1, GPU 1")
        and "of this Ray cluster has" in said[0]
        and "waits until such a node joins" in said[0]
    )


def test_a_variant_failing_on_ray_keeps_every_stage_that_finished(tmp_path, workdir, monkeypatch):
    """`--executor ray` with a variant whose chain fails after its checkpoint, listed before one that passes: the
    run fails with that variant's own error, and the ledger holds every stage that finished, the failed chain's
    checkpoint and the whole chain that ran beside it, so a re-run rebuilds nothing (before, the driver dropped what
    the tasks returned once one had failed). The failure: a TensorRT-LLM bundle cannot be verified without CUDA (a
    spec file naming one is refused at load now; the spec object here is built without that check)."""
    import yaml

    from qgate.errors import BackendUnavailable
    from qgate.pipeline.jobs import run_pipeline
    from qgate.pipeline.spec import PipelineSpec

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = yaml.safe_load(pipeline_spec(tmp_path, workdir).read_text())
    data["variants"] = [
        {
            "name": "trt",
            "scheme": "gptq-w8a16",
            "options": {"group_size": 32},
            "engine": {"backend": "trtllm"},
            "resources": {"num_cpus": 1},
        },
        {"name": "w8", "scheme": "gptq-w8a16", "options": {"group_size": 32}, "resources": {"num_cpus": 1}},
    ]
    spec, said = PipelineSpec(**data, root=tmp_path.resolve()), []
    with pytest.raises(BackendUnavailable, match="TensorRT-LLM bundle not built: it cannot be verified"):
        run_pipeline(spec, echo=said.append, executor="ray")
    assert any(
        m.startswith("  ! trt failed: TensorRT-LLM bundle not built") and "every finished stage is kept" in m
        for m in said
    )
    ledger = json.loads((tmp_path / "work" / "stages.json").read_text())
    assert {"quantize:trt", "quantize:w8", "gate:w8"} <= set(ledger) and "engine:trt" not in ledger
    built = {d: (tmp_path / "work/variants" / d).stat().st_ino for d in ("trt/checkpoint", "w8/checkpoint", "w8/gate")}
    said.clear()
    with pytest.raises(BackendUnavailable):
        run_pipeline(spec, echo=said.append, executor="ray")
    assert not any("stale lock" in m for m in said)  # the failed run released its lock cleanly
    assert {d: (tmp_path / "work/variants" / d).stat().st_ino for d in built} == built  # nothing was built again


class _TwoArgs(Exception):
    def __init__(self, what: str, where: str):  # pickles, but cannot be rebuilt from its message alone
        super().__init__(f"{what} at {where}")


def test_a_failed_chains_error_reaches_the_driver_whatever_its_class():
    """A chain's error travels back beside its finished stages: as itself when it survives a pickle round trip, else
    as a QgateError with its type and message (never a serialization error that would lose the stages too)."""
    from qgate.pipeline.jobs import _portable

    same = InputError("part-1.jsonl:7: bad record", hint="fix the writer")
    assert _portable(same) is same
    odd = _portable(_TwoArgs("CUDA out of memory", "layer 3"))
    assert type(odd) is QgateError and str(odd) == "_TwoArgs: CUDA out of memory at layer 3"
