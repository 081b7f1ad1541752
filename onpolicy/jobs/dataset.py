"""Prompt/answer datasets: the built-in generated arithmetic task and JSONL files."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .spec import DatasetSpec


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class DatasetError(ValueError):
    pass


def arithmetic(size: int, max_operand: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(["+", "-", "*"])
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(Problem(f"What is {a} {op} {b}? Answer with just the number.", str(value)))
    return out


def read_jsonl(path: str) -> list[Problem]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset {path}: no such file")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"dataset {path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "answer" not in obj:
            raise DatasetError(f'dataset {path}:{n}: expected {{"prompt": str, "answer": ...}}')
        out.append(Problem(obj["prompt"], str(obj["answer"])))
    if not out:
        raise DatasetError(f"dataset {path}: no problems")
    return out


def load_dataset(spec: DatasetSpec) -> list[Problem]:
    if spec.kind == "arithmetic":
        return arithmetic(spec.size, spec.max_operand, spec.seed)
    return read_jsonl(spec.path)


def batch_at(problems: list[Problem], cursor: int, count: int) -> list[Problem]:
    """``count`` problems starting at ``cursor``, wrapping around (the data cursor is ``step * count``)."""
    return [problems[(cursor + i) % len(problems)] for i in range(count)]
