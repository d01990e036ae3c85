"""Print one flag's value as the trainer would see it: RECIPE.yaml, then the flags after it.

    python recipes/slurm/recipe_value.py recipes/asa-1.3b-100b.yaml save [--save DIR ...]

train.sbatch uses it to find the checkpoint folder every attempt resumes from. The trainer's own
parser reads the file and the flags (the same aliases, the same later-wins order), without its
start-up checks; an unset flag prints nothing. Exits 2 naming the key when it is no flag.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    from megatron_subq.training.arguments import (  # noqa: PLC0415
        _load_config_file,
        build_parser,
        config_to_argv,
    )

    recipe, key, flags = argv[0], argv[1], list(argv[2:])
    parser = build_parser()
    dest = key.lstrip("-").replace("-", "_")
    if dest not in {a.dest for a in parser._actions}:
        print(f"recipe_value.py: {key!r} is not a trainer flag", file=sys.stderr)
        return 2
    args, _ = parser.parse_known_args(
        config_to_argv(parser, _load_config_file(recipe), recipe) + flags)
    value = getattr(args, dest)
    if value is not None:
        print(" ".join(map(str, value)) if isinstance(value, list) else value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
