"""Write docs/spec.md: every key of a pipeline spec, its default and its meaning, read from the configs themselves.

    .venv/bin/python scripts/spec_reference.py            # rewrite docs/spec.md
    .venv/bin/python scripts/spec_reference.py --check    # exit 1 if docs/spec.md is out of date (tests run this)

A spec section is built from a stage's frozen config (pipeline/spec.py), so the table is generated from those
classes: a field's meaning is the comment on its line in the source.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "spec.md"

HEAD = """# The pipeline spec

`qgate run SPEC` reads one strict YAML file. An unknown key, scheme, option or backend is refused when the spec loads,
with the key's path and a suggestion; so is a value of the wrong type (`4.5` for an integer, `1` for a boolean) or out
of its range, a key given twice in one mapping (plain YAML would keep the last silently), and a variant that could
never be gated. One load reports every such problem, each on its own line with its hint: first the spec's top-level
shape, then, once that is right, every section's keys, types and values.
Relative paths are relative to the spec file. `pipelines/promote.yaml` (the demo) and `pipelines/gpu.yaml` are
complete examples.

A gate threshold is `null` (the value is reported, not gated on) or a finite number in its range: (0, 1] for a share
(`*_agreement_min`, `identical_generation_min`, `min_recovery`), above 0 for a divergence, an increase or a speed-up.
Outside it a check could never fail, or never pass, so such a value is refused. The names in `registry` and `promote`
follow MLflow's rules: a model name without `/` or `:`, an alias of letters, digits, `_` and `-`.

This page is generated from the configs the sections are built from (`scripts/spec_reference.py`; a test fails when
it is out of date), so each default below is the one the code uses.

```yaml
version: 1
name: my-model                 # names the run in logs and reports
workdir: ../.qgate/my-model     # stages, caches and reports; a re-run skips what is unchanged
model: {hf_dir: ../models/base}   # or gguf_package / gguf_file
traffic: ../logs/              # a file, a quoted glob, a directory of partitions, or s3://bucket/prefix/
calibrate: {calib_size: 256, shadow_size: 64}
quantize: {max_seq_length: 512}
variants:
  - name: awq-w4-cpu
    scheme: awq-w4a16                  # awq-w4a16, gptq-w4a16, gptq-w8a16, fp8-dynamic
    options: {group_size: 64}
    engine: {backend: cpu}             # cpu, torch-int4 (trtllm bundles are built by `qgate engine build`)
  - name: gptq-w8
    scheme: gptq-w8a16                 # no engine: gated on the PyTorch reference path
gates: {shadow: {kl_p99_max: 0.5}}
registry: {model_name: my-model}
promote: {alias: production, choose: best}   # best, smallest or first among the passing variants
```
"""


def _comments(cls) -> dict[str, str]:
    """Field name -> the comment on its line in the class's source (continued on following comment-only lines)."""
    out, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+(?:= .*?)?(?:\s+#\s*(.*))?$", line)
        if m and not line.strip().startswith("#"):
            last = m.group(1)
            out[last] = (m.group(2) or "").strip()
        elif last and line.strip().startswith("#"):
            out[last] += " " + line.strip().lstrip("# ")
        else:
            last = None
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(v):
        return "(section)"
    return "null" if v is None else f"`{v!r}`".replace("'", '"')


def _table(cls, skip: tuple[str, ...] = ()) -> str:
    notes = _comments(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        t = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
        t = re.sub(r"\w+\.(\w+Config)", r"\1", t).replace("|", "or")
        rows.append(f"| `{f.name}` | {t} | {_default(f)} | {notes.get(f.name, '').replace('|', '/')} |")
    return "\n".join(rows)


def render() -> str:
    from qgate.calibrate.sample import SampleConfig
    from qgate.calibrate.traffic_drift import DriftConfig
    from qgate.engines.build import BACKENDS, backend
    from qgate.gates.contract import ContractConfig
    from qgate.gates.evalgate import EvalConfig
    from qgate.gates.gating import GateConfig
    from qgate.gates.longctx import LongContextConfig
    from qgate.gates.parity import ParityConfig
    from qgate.gates.perf import PerfConfig
    from qgate.gates.shadow import ShadowConfig
    from qgate.quantize.compress import CalibOptions
    from qgate.search.plan import SearchConfig

    sections = [
        ("`calibrate:`", "calibrate/sample.py", SampleConfig, ()),
        ("`quantize:`", "quantize/compress.py", CalibOptions, ()),
        ("`variants[].search:`", "search/plan.py", SearchConfig, ()),
        (
            "`gates:`",
            "gates/gating.py; each sub-section below is its gate's own config",
            GateConfig,
            ("contract", "shadow", "eval", "long_context", "perf", "parity"),
        ),
        ("`gates.shadow:`", "gates/shadow.py", ShadowConfig, ()),
        ("`gates.contract:`", "gates/contract.py", ContractConfig, ()),
        ("`gates.eval:` (null: no eval gate)", "gates/evalgate.py", EvalConfig, ()),
        ("`gates.long_context:` (null: not probed)", "gates/longctx.py", LongContextConfig, ()),
        ("`gates.parity:`", "gates/parity.py", ParityConfig, ()),
        ("`gates.perf:`", "gates/perf.py", PerfConfig, ()),
        ("`drift:`", "calibrate/traffic_drift.py", DriftConfig, ()),
    ]
    parts = [HEAD]
    parts.append(
        "## `variants:`\n\nEach variant: `name` (letters, digits, `-`, `_`, `.`), `scheme` and its `options` "
        "(quantize/schemes.py), `kv_cache` (`fp8` or `int8`; the `cpu` and `torch-int4` engines keep their KV caches "
        "in float and refuse it at load), `engine` (`backend` and its `options`; none: the "
        "checkpoint is gated on the PyTorch reference path), `search` (below) and `resources` (Ray task resources "
        "under `--executor ray`: `num_cpus`, `num_gpus`, `memory` in bytes, or custom ones).\n\n"
        "Engine backends (engines/build.py):\n\n| backend | what it is | gated by qgate |\n| --- | --- | --- |\n"
        + "\n".join(
            f"| `{n}` | {backend(n).description} | "
            f"{'yes' if backend(n).runner else 'no: bundle it from a promoted checkpoint'} |"
            for n in BACKENDS.names()
        )
    )
    for title, where, cls, skip in sections:
        parts.append(f"## {title}\n\nDefined in `src/qgate/{where}`.\n\n{_table(cls, skip)}")
    parts.append(
        "## `registry:` and `promote:`\n\n`registry.model_name` (required), `registry.store` (default `.qgate/mlflow`, "
        "an embedded SQLite store; `MLFLOW_TRACKING_URI` overrides it). `promote.alias` (default `production`), "
        "`promote.choose`: `best` (lowest shadow KL p99), `smallest` (the fewest bytes of weights in what is "
        "served: an engine's own model files, a checkpoint's safetensors; ties by KL) or `first` (spec order) among "
        "the passing variants."
    )
    return "\n\n".join(parts).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/spec_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
