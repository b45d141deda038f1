import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qgate")


@pytest.fixture(scope="session")
def base_art(workdir):
    from qgate.models import ModelSource, import_model

    src = tiny.make_model(workdir / "tiny-src")
    return import_model(ModelSource(hf_dir=str(src)), workdir / "base")


@pytest.fixture(scope="session")
def calib_arts(workdir):
    from qgate.calibrate.sample import SampleConfig, sample_traffic

    traffic = tiny.make_traffic(workdir / "traffic.jsonl", n=300)
    return sample_traffic(traffic, workdir / "calib", SampleConfig(calib_size=32, shadow_size=24, seed=0))


@pytest.fixture(scope="session")
def awq_art(workdir, base_art, calib_arts):
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    return quantize(
        base_art,
        calib_arts["calib"],
        scheme_config("awq-w4a16", group_size=32),
        workdir / "awq",
        opts=CalibOptions(max_seq_length=64),
    )


@pytest.fixture(scope="session")
def int4_f32(awq_art, calib_arts, workdir):
    """The AWQ checkpoint as a float32 torch-int4 engine."""
    from qgate.engines.build import build_engine

    return build_engine(awq_art, "torch-int4", workdir / "int4-f32", calib_arts["profile"], dtype="float32")


@pytest.fixture(scope="session")
def w8_art(workdir, base_art, calib_arts):
    from qgate.quantize.compress import CalibOptions, quantize
    from qgate.quantize.schemes import scheme_config

    return quantize(
        base_art,
        calib_arts["calib"],
        scheme_config("gptq-w8a16", group_size=32),
        workdir / "w8",
        opts=CalibOptions(max_seq_length=64),
    )


@pytest.fixture(scope="session")
def gated(base_art, w8_art, awq_art, calib_arts, workdir):
    """w8 passes lenient thresholds; awq fails an impossible KL threshold."""
    from qgate.gates.evalgate import EvalConfig
    from qgate.gates.gating import GateConfig, run_gates
    from qgate.gates.shadow import ShadowConfig

    lenient = GateConfig(
        shadow=ShadowConfig(
            max_new_tokens=8, max_prompt_tokens=48, kl_p99_max=None, kl_mean_max=10.0, top1_agreement_min=None
        ),  # 192 answer tokens cannot bound a p99
        eval=EvalConfig(tasks=("bigbench_general_knowledge",), limit=8, min_recovery=None, max_bpb_increase=None),
    )
    strict = GateConfig(  # 24 prompts x 16 answer tokens: 384 positions, enough to bound p99
        shadow=ShadowConfig(max_new_tokens=16, max_prompt_tokens=48, kl_p99_max=1e-4), eval=None
    )
    ok = run_gates(w8_art, base_art, calib_arts["shadow"], lenient, workdir / "reg-ok", workdir / "cache-reg")
    bad = run_gates(awq_art, base_art, calib_arts["shadow"], strict, workdir / "reg-bad", workdir / "cache-reg")
    assert ok.meta["passed"] and not bad.meta["passed"]
    return ok, bad


@pytest.fixture
def partition_opens(monkeypatch):
    """A Counter of how many times each traffic partition is opened for reading in this process (by its name)."""
    from collections import Counter

    from qgate.calibrate import sources

    opened: Counter = Counter()
    real_open = sources.Partition.open

    def counting_open(self, digest=None):
        opened[self.name] += 1
        return real_open(self, digest)

    monkeypatch.setattr(sources.Partition, "open", counting_open)
    return opened
