import dataclasses

import pytest

import dlo


def test_defaults():
    config = dlo.OffloadConfig()
    assert (config.num_slots, config.resident_layers, config.pin_memory, config.record_timeline) == (2, 0, True, False)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        dlo.OffloadConfig().num_slots = 3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_slots", 1, "num_slots must be >= 2"),
        ("num_slots", 0, "num_slots must be >= 2"),
        ("num_slots", 2.0, "num_slots must be an int"),
        ("num_slots", True, "num_slots must be an int"),
        ("num_slots", "2", "num_slots must be an int"),
        ("resident_layers", -1, "resident_layers must be >= 0"),
        ("resident_layers", 1.5, "resident_layers must be an int"),
        ("pin_memory", 1, "pin_memory must be True or False"),
        ("record_timeline", "yes", "record_timeline must be True or False"),
        ("gather_chunk_mib", -1, "gather_chunk_mib must be a finite number of MiB >= 0"),
        ("gather_chunk_mib", float("inf"), "gather_chunk_mib must be a finite number of MiB >= 0"),
        ("gather_chunk_mib", True, "gather_chunk_mib must be a finite number of MiB >= 0"),
        ("gather_chunk_mib", "64", "gather_chunk_mib must be a finite number of MiB >= 0"),
    ],
)
def test_invalid_values_name_the_option(field, value, message):
    with pytest.raises(dlo.ConfigError, match=message):
        dlo.OffloadConfig(**{field: value})


def test_gather_chunk_in_bytes():
    def chunk_bytes(mib):
        return dlo.OffloadConfig(use_allgather=True, gather_chunk_mib=mib).gather_chunk_bytes

    assert chunk_bytes(0) == 0
    assert chunk_bytes(64) == 64 * 2**20
    assert chunk_bytes(1e-9) == 1  # positive stays positive


def test_a_chunk_size_without_all_gather_is_refused():
    with pytest.raises(dlo.ConfigError, match="gather_chunk_mib=32 sizes all-gather mode's collectives .* use_allgather=True"):
        dlo.OffloadConfig(gather_chunk_mib=32)
    assert dlo.OffloadConfig().gather_chunk_mib == 64  # the default needs nothing


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        dlo.OffloadConfig(num_slots=1)
