"""Measuring against the full model: the prompt sets, metrics and figures as pure
functions of traces, teacher-forced replay, ``eval`` and ``bench``."""
