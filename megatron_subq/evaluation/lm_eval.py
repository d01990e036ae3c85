"""lm-evaluation-harness's command line with the ``megatron_subq`` model registered.

    python -m megatron_subq.evaluation.lm_eval --model megatron_subq \
        --model_args load=runs/asa --tasks lambada_openai,piqa --batch_size 8
    torchrun --nproc-per-node 2 -m megatron_subq.evaluation.lm_eval --model megatron_subq \
        --model_args load=runs/asa,tensor_model_parallel_size=2 --tasks piqa

Takes exactly ``lm_eval``'s arguments (``lm_eval --help``). lm-eval 0.4.13 resolves ``--model``
only against its own registry and loads no plugins, so this module imports
``megatron_subq.evaluation.lm_eval_model`` (which registers the model) and then runs lm-eval's
``cli_evaluate``.
"""

from __future__ import annotations

import sys


def main(argv=None) -> None:
    """Run lm-eval's command line on ``argv`` (default: ``sys.argv[1:]``)."""
    try:
        from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415
    except ImportError as e:
        raise SystemExit("megatron_subq.evaluation.lm_eval needs lm-evaluation-harness: "
                         'pip install -e ".[eval]"') from e
    from . import lm_eval_model  # noqa: F401,PLC0415  (registers --model megatron_subq)

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    cli_evaluate()


if __name__ == "__main__":
    main()
