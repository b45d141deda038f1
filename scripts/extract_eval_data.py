"""Extract the small offline eval sets qgate ships, with attribution.

    python scripts/extract_eval_data.py --bigbench-sdist bigbench-1.0.0.tar.gz

Run once by a maintainer; the output under src/qgate/gates/tasks/data/ is committed.
Multiple-choice items come from BIG-bench (Apache-2.0), perplexity documents from
chatterbot-corpus (BSD-3-Clause). Each source is subsampled with a fixed seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import tarfile
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "src/qgate/gates/tasks/data"
# Short English multiple-choice tasks with one best answer. The default pool (qgate.gates.evalgate.DEFAULT_TASKS,
# 1,617 items) takes tasks whose answers are written per item: general_knowledge, social_iqa, ruin_names,
# movie_recommendation, unit_identification and goal_inference. Tasks whose answers are a fixed pair such as
# plausible/implausible (misconceptions, sports_understanding, strategyqa, anachronisms, implicatures, metaphor_boolean)
# ship too, outside the default: a small model answers them by label bias, so their items add n without adding power.
# Earlier subsets keep their items: same seed and order, a longer or shorter slice.
BIGBENCH_TASKS = {
    "general_knowledge": 70,
    "social_iqa": 300,
    "misconceptions": 219,
    "sports_understanding": 400,
    "strategyqa": 700,
    "anachronisms": 230,
    "implicatures": 300,
    "metaphor_boolean": 300,
    "ruin_names": 448,
    "movie_recommendation": 300,
    "unit_identification": 250,
    "goal_inference": 250,
}
SUBTASKS = {
    "unit_identification": "unit_conversion/unit_identification",
    "goal_inference": "goal_step_wikihow/goal_inference",
}
PPL_DOCS = 300  # bits per byte over 300 conversations: a CI about 1 point wide at the demo's 5% limit
TASK_YAML = """# BIG-bench {task} (Apache-2.0), subset: see data/ATTRIBUTION.md
task: bigbench_{task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/bigbench_{task}.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1
"""
SEED = 1234
# Tasks whose items are ambiguous without the task's own instruction (task_prefix, output prefix): it is kept.
INSTRUCTED = {"sports_understanding", "anachronisms", "implicatures", "metaphor_boolean"}


def bigbench_items(sdist: Path, task: str, limit: int) -> list[dict]:
    member = f"bigbench-1.0.0/bigbench/benchmark_tasks/{SUBTASKS.get(task, task)}/task.json"
    with tarfile.open(sdist) as tar:
        data = json.load(tar.extractfile(member))
    items = []
    for ex in data["examples"]:
        scores = ex.get("target_scores")
        if not scores:
            continue
        choices = list(scores)
        best = max(scores.values())
        answers = [i for i, c in enumerate(choices) if scores[c] == best]
        if len(answers) != 1:  # ambiguous gold: not usable for accuracy
            continue
        question = ex["input"].strip()
        if task in INSTRUCTED:
            ask = (data.get("example_output_prefix") or "").replace("A:", "").strip()
            question = "\n".join(p for p in (data.get("task_prefix", "").strip(), question, ask) if p)
        items.append({"question": question, "choices": choices, "answer": answers[0]})
    random.Random(SEED).shuffle(items)
    return items[:limit]


def chatterbot_docs(limit: int = PPL_DOCS) -> list[dict]:  # the first 120 are the earliest subset
    root = Path(importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0])
    docs = []
    for f in sorted((root / "data/english").glob("*.yml")):
        convs = yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations", [])
        for conv in convs:
            turns = [str(t).strip() for t in conv if str(t).strip()]
            if len(turns) >= 2:
                docs.append({"text": "\n".join(turns), "source": f.name})
    random.Random(SEED).shuffle(docs)
    return docs[:limit]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bigbench-sdist", type=Path, required=True)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for task, limit in BIGBENCH_TASKS.items():
        rows = bigbench_items(args.bigbench_sdist, task, limit)
        (OUT / f"bigbench_{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        yaml_path = OUT.parent / f"bigbench_{task}.yaml"
        if not yaml_path.exists():
            yaml_path.write_text(TASK_YAML.format(task=task))
        print(task, len(rows))
    docs = chatterbot_docs()
    (OUT / "chatterbot_ppl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in docs))
    print("chatterbot", len(docs))


if __name__ == "__main__":
    main()
