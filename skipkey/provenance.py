"""Where a result came from: the machine it was measured on and the command that made it.

Every JSON result and every adapter's metadata names both, so a figure can be rerun.
"""

from __future__ import annotations

import os
import platform
import shlex
from collections.abc import Sequence

import torch


def machine_description(device: torch.device) -> str:
    """What the figures were measured on: the GPU's name, or the CPU model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def command_line(argv: Sequence[str]) -> str:
    """The ``python -m skipkey`` line for these arguments, quoted for a shell."""
    return shlex.join(["python", "-m", "skipkey", *map(str, argv)])
