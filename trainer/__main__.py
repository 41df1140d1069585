"""`python -m trainer --config run.yaml --result out.jsonl [--set key=value ...] [--serve requests.jsonl]`, normally
under torchrun (``trainer.worker``). With ``--serve`` the process stays up after the run and runs the trials the
requests file names."""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from trainer.config import ConfigError, TrainConfig
from trainer.exit_signals import die_with_parent, stacks_on_sigterm
from trainer.protocol import ResultWriter, error_record


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    p.add_argument("--config", required=True, help="TrainConfig YAML")
    p.add_argument("--result", help="JSON-lines file the job appends its windows, summary and errors to")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting by dotted path, e.g. --set training.batch_size=128 (YAML value)")
    p.add_argument("--cancel", metavar="FILE", help="end the run at the end of a window once this file exists")
    p.add_argument("--serve", metavar="REQUESTS",
                   help="after the run, run the trials appended to this JSON-lines file until a stop request")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> TrainConfig:
    cfg = TrainConfig.from_yaml(args.config)
    if args.overrides:
        pairs = [o.split("=", 1) for o in args.overrides]
        bad = [o for o, pair in zip(args.overrides, pairs, strict=True) if len(pair) != 2]
        if bad:
            raise ConfigError([f"--set {b}: expected KEY=VALUE" for b in bad])
        cfg = cfg.with_overrides({k: yaml.safe_load(v) for k, v in pairs})
    return cfg


def main(argv=None) -> int:
    # Under torchrun: die with the agent even when it is SIGKILLed (it cannot clean up its ranks then).
    die_with_parent()
    stacks_on_sigterm()
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        writer = ResultWriter(args.result, int(os.environ.get("RANK", 0)))
        writer.write(error_record(e), any_rank=True)
        writer.close()
        print("trainer: invalid config:\n  " + "\n  ".join(e.problems), file=sys.stderr)
        return 3
    # The job imports torch: only now, so that a bad config is reported in a fraction of a second.
    from trainer.worker import run, serve

    if args.serve:
        return serve(cfg, args.result, args.serve, cancel=args.cancel)
    return run(cfg, args.result, cancel=args.cancel)


if __name__ == "__main__":
    code = main()
    # Skip interpreter finalization: gloo's worker threads can still hold tensors then, and one that reaches for
    # the GIL while Python tears down aborts the rank ("terminate called without an active exception", SIGABRT after
    # a complete run, often enough in short CPU jobs). Everything the job writes is closed by now; only stdio needs a
    # flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
