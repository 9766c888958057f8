"""Keeping other libraries' warnings and notices out of dlo's normal output (`-v` shows them)."""

from __future__ import annotations

import logging
import os
import warnings

# Loggers of the libraries dlo drives; their own verbosity variables also reach spawned ranks.
_LIBRARIES = {"diffusers": "DIFFUSERS_VERBOSITY", "transformers": "TRANSFORMERS_VERBOSITY"}


def quiet_other_libraries(verbose: bool) -> None:
    """dlo's own warnings (fallback codes) always show; other libraries' only with `verbose`."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if verbose:
        logging.getLogger("dlo").setLevel(logging.INFO)  # e.g. hashing rates
        return
    for name, variable in _LIBRARIES.items():
        # The variable covers a library that configures its logger later (at first import),
        # setLevel one that already did.
        os.environ.setdefault(variable, "error")
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"^(?!dlo(\.|$))")


def quiet_loading_bars() -> None:
    """Where quiet_other_libraries ran (in this process or a parent: its TRANSFORMERS_VERBOSITY
    reaches spawned ranks and replicas), hide transformers' "Loading weights" bar of each text
    encoder but keep the hub's download bars. It imports transformers (seconds): call it where
    a pipeline loads, not for every command."""
    if os.environ.get(_LIBRARIES["transformers"]) != "error":
        return
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    downloads_shown = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # it also turns off the hub's download bars...
    if downloads_shown:
        enable_progress_bars()  # ...so turn those back on
