"""``onpolicy export JOB_ID|CHECKPOINT --hf OUT``: a trained model as an HF directory (config,
safetensors, tokenizer and chat template) that transformers and vLLM load."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import fail


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a job's (or a checkpoint's) trained model as an HF directory")
    p.add_argument("source", help="a job id (its latest checkpoint), a checkpoint directory (with `latest`) or "
                                  "one step directory")
    p.add_argument("--hf", required=True, metavar="OUT", help="the HF directory to write (must not exist)")
    p.add_argument("--state-dir", help="the controller state directory holding the job "
                                       "(default $ONPOLICY_HOME/controller)")
    p.set_defaults(func=run)


def checkpoint_root(source: str, state_dir: Path) -> Path:
    """The checkpoint directory ``source`` names: itself, or the checkpoints of job ``source``."""
    path = Path(source)
    if path.is_dir():
        return path
    record = state_dir / "jobs" / source / "job.json"
    if not record.is_file():
        fail(f"{source}: neither a checkpoint directory nor a job in {state_dir}")
    from onpolicy.jobs.spec import parse_spec
    from onpolicy.services.controller.paths import job_root

    try:
        spec = parse_spec(json.loads(record.read_text())["spec"])
    except (OSError, ValueError, KeyError) as e:  # SpecError is a ValueError
        fail(f"{record}: unreadable job record ({e})")
    return job_root(spec, source, record.parent) / "checkpoints"


def run(args: argparse.Namespace) -> int:
    from onpolicy.models.hf_export import export_trained
    from onpolicy.models.loading import ModelLoadError
    from onpolicy.trainer.checkpoint import CheckpointError, load_checkpoint

    from .up_cmd import default_state_dir

    root = checkpoint_root(args.source, Path(args.state_dir) if args.state_dir else default_state_dir())
    try:
        state = load_checkpoint(root)
    except CheckpointError as e:
        fail(str(e).splitlines()[0])
    try:
        out = export_trained(state.model, state.model_name, Path(args.hf))
    except (FileExistsError, ModelLoadError, OSError) as e:
        fail(str(e).splitlines()[0])
    print(f"exported {state.model_name} at step {state.step} to {out}", file=sys.stderr)
    print(out)
    return 0
