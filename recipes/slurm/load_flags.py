"""Print the --load flags one attempt of a recipe needs: resume its own run, or start it from
another run's weights.

    python recipes/slurm/load_flags.py RECIPE.yaml [trainer flags ...]

Contract (train.sbatch calls it on every attempt, tools/curriculum.py before every local run):
- the recipe's ``save`` folder holds a checkpoint (a tracker file): ``--load SAVE --no-finetune``
  (a requeued or re-run attempt continues its own run: optimizer, schedule, data position);
- else, the recipe names another ``load`` (a fine-tuning stage starting from the previous stage's
  or an import's weights): nothing (the recipe's ``load`` and ``finetune`` stand);
- else ``--load SAVE`` (a fresh run that will resume from its own saves; the first attempt finds
  nothing and starts from scratch, Megatron-LM's idiom).
Why: appending ``--load SAVE`` unconditionally (the launcher's old behaviour) made a fine-tuning
recipe's first attempt start from random weights.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def load_flags(recipe: str, flags=()) -> list:
    """The flags (a list of strings) per the contract above; raises ValueError when no ``save``."""
    from megatron_subq.training.arguments import (  # noqa: PLC0415
        _load_config_file,
        build_parser,
        config_to_argv,
    )

    parser = build_parser()
    args, _ = parser.parse_known_args(
        config_to_argv(parser, _load_config_file(recipe), recipe) + list(flags))
    if not args.save:
        raise ValueError(f"{recipe}: the recipe (or the flags after it) must set save")
    save = args.save
    if os.path.isfile(os.path.join(save, "latest_checkpointed_iteration.txt")):
        return ["--load", save, "--no-finetune"]
    if args.load and os.path.normpath(args.load) != os.path.normpath(save):
        return []
    return ["--load", save]


def main(argv) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        print(" ".join(load_flags(argv[0], argv[1:])))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
