"""The closed set of errors dlo raises. Each message names the option or object and the fix."""


class DloError(Exception):
    """Base class of every error dlo raises on purpose."""


def first_line(err: BaseException) -> str:
    """The first line of another library's error, for a one-line message quoting it."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class ConfigError(DloError, ValueError):
    """An `OffloadConfig` field or an `enable()` argument is invalid."""


class DiscoveryError(DloError, LookupError):
    """No streamable blocks were found, or a plan names blocks the module does not have."""


class EnableError(DloError, RuntimeError):
    """The module cannot be put under dlo as it is (already enabled, shared tensors...)."""


class StreamingError(DloError, RuntimeError):
    """The module changed under dlo, or was called in a way streaming cannot serve."""
