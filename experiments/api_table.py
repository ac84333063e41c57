"""docs/api.md's table of the app's ``/compare`` (and ``/metrics``) parameters, from the controls' declaration:
every control, in the API's order, with what it accepts, its default and what it sets.

    python -m experiments.api_table

prints the markdown table; ``tests/test_app.py`` fails when docs/api.md's copy differs. A new control appears here
once it is declared (``skipkey.serving.request.Controls``) and has its widget (``app_widgets.WIDGETS``).
"""

from __future__ import annotations

from app_handlers import Handlers
from app_widgets import api_table
from skipkey.serving.models import ModelCache


def table() -> str:
    """The table at the API's defaults: the page's, with the default model's adapter's layer policy."""
    return api_table(Handlers(ModelCache()).defaults())


if __name__ == "__main__":
    print(table())
