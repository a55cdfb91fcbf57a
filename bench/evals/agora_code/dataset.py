"""The `agora_code_*` lm-eval tasks' documents: code_mc.jsonl beside this file, read without a download.

lm-eval calls `load` (the tasks' `custom_dataset`) with the task's metadata; the documents are
short Python contexts, each with four continuations of which `gold` is the one the code needs, so
they fit a small model's context (the tiny preset's 256 tokens) and score in seconds on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import Dataset, DatasetDict

__all__ = ["load", "DOCUMENTS"]

DOCUMENTS = Path(__file__).resolve().parent / "code_mc.jsonl"


def load(**_metadata) -> DatasetDict:
    with DOCUMENTS.open(encoding="utf-8") as lines:
        documents = [json.loads(line) for line in lines if line.strip()]
    return DatasetDict({"test": Dataset.from_list(documents)})
