"""Keeping other libraries' warnings and notices out of dlo's normal output (`-v` shows them)."""

from __future__ import annotations

import logging
import os
import warnings

# Loggers of the libraries dlo drives; their own verbosity variables also reach spawned ranks.
_LIBRARIES = {"diffusers": "DIFFUSERS_VERBOSITY", "transformers": "TRANSFORMERS_VERBOSITY"}


class _Formatter(logging.Formatter):
    """`LEVEL logger: message`; dlo's own messages already start with "dlo: " (for programs that
    never configure logging: Python's last-resort handler prints the message alone), so theirs
    are `LEVEL dlo: message`, not `LEVEL dlo.host.cache.consume: dlo: message`."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self._own = logging.Formatter("%(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        own = record.name.partition(".")[0] == "dlo" and record.getMessage().startswith("dlo: ")
        return self._own.format(record) if own else super().format(record)


def quiet_other_libraries(verbose: bool) -> None:
    """dlo's own warnings (fallback codes) always show; other libraries' only with `verbose`."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Formatter())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
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
    reaches spawned ranks and replicas), hide the bars of loading and saving a pipeline:
    diffusers' "Loading pipeline components", transformers' "Loading weights" of each text
    encoder and its "Writing model shards"; keep the hub's download bars, and the pipeline's
    own bar of the denoising steps. It imports diffusers and transformers (seconds): call it
    where a pipeline loads or is written, not for every command."""
    if os.environ.get(_LIBRARIES["transformers"]) != "error":
        return
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()  # its loaders' bars only (not a pipeline call's)

    downloads_shown = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # it also turns off the hub's download bars...
    if downloads_shown:
        enable_progress_bars()  # ...so turn those back on
