"""Pipeline specs for the tiny model, shared by the pipeline, drift, search and fault tests."""

import tiny
import yaml


def gates_spec(path, gates, scheme="awq-w4a16"):
    """The smallest spec a `gates:` section loads in (its model and traffic are never read), written to `path`."""
    doc = {
        "version": 1,
        "name": "t",
        "workdir": "w",
        "model": {"hf_dir": "x"},
        "traffic": "t.jsonl",
        "variants": [{"name": "a", "scheme": scheme}],
        "registry": {"model_name": "m"},
        "gates": gates,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def pipeline_spec(tmp_path, workdir, **over):
    src = workdir / "tiny-src"
    if not src.exists():
        tiny.make_model(src)
    tiny.make_traffic(tmp_path / "traffic.jsonl", n=240, bad_lines={5: "{oops"})
    spec = {
        "version": 1,
        "name": "tiny",
        "workdir": "work",
        "model": {"hf_dir": str(src)},
        "traffic": "traffic.jsonl",
        "calibrate": {"calib_size": 24, "shadow_size": 48},  # 48 prompts x 16 answer tokens: enough to bound p99
        "quantize": {"max_seq_length": 48},
        "variants": [
            {
                "name": "awq-cpu",
                "scheme": "awq-w4a16",
                "options": {"group_size": 32},
                "engine": {"backend": "cpu", "options": {"accuracy_level": 1}},
            },
            {"name": "w8", "scheme": "gptq-w8a16", "options": {"group_size": 32}},
        ],
        "gates": {
            "shadow": {
                "max_new_tokens": 16,
                "max_prompt_tokens": 48,
                "kl_p99_max": None,
                "kl_mean_max": 0.005,
                "top1_agreement_min": 0.8,
            },
            "eval": {
                "tasks": ["bigbench_general_knowledge", "chatterbot_ppl"],
                "limit": 69,
                "min_recovery": 0.5,
                "max_bpb_increase": 0.2,
            },
        },
        "registry": {"model_name": "tiny-llm", "store": "mlflow"},
    }
    spec.update(over)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def drift_spec(tmp_path, src, variants, gates, drift=None, name="spec.yaml"):
    spec = {
        "version": 1,
        "name": "tiny-drift",
        "workdir": "work",
        "model": {"hf_dir": str(src)},
        "traffic": "traffic.jsonl",
        "calibrate": {"calib_size": 24, "shadow_size": 48},
        "quantize": {"max_seq_length": 48},
        "variants": variants,
        "gates": gates,
        "registry": {"model_name": "tiny-llm", "store": "mlflow"},
        "drift": drift or {},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


SHIFT = {"route_weights": (1, 8, 1), "tenants": ("t1", "t2"), "lengths": (30, 90)}  # code-heavy, long, a new tenant
W8 = {"name": "w8", "scheme": "gptq-w8a16", "options": {"group_size": 32}}
AWQ = {"name": "awq", "scheme": "awq-w4a16", "options": {"group_size": 32}}
SHADOW = {"max_new_tokens": 16, "max_prompt_tokens": 48, "kl_p99_max": None}
STRICT = {"shadow": SHADOW | {"kl_mean_max": 0.005, "top1_agreement_min": 0.8}, "eval": None}  # w8 passes, awq fails
LENIENT = {"shadow": SHADOW | {"kl_mean_max": 10.0, "top1_agreement_min": None}, "eval": None}  # both pass


def mlflow_client(root):
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'mlflow' / 'mlflow.db'}"
    return MlflowClient(uri, uri)  # the registry URI too: MLflow's default is the process-wide one qgate last set


def model_alias(root, alias="production"):
    return str(mlflow_client(root).get_model_version_by_alias("tiny-llm", alias).version)
