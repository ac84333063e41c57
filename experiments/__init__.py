"""The experiments behind the figures in docs/results: each module is run from the repository root as
``python -m experiments.NAME`` and writes its data under ``assets/results``. They use only SkipKey's public API.
``gpu.sh`` (the GPU check) and ``speed.sh`` (every speed figure) are run with ``bash experiments/NAME.sh``.
"""
