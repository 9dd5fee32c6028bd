"""prefill_accel.flags: the engines' --sparse-prefill-* flags, validated with the flag named."""

import dataclasses

import pytest

from prefill_accel import SparsePrefillConfig
from prefill_accel.flags import SUFFIXES, changed_flags, flag, kernel_field, settings_from_flags


def test_every_kernel_setting_has_a_flag():
    kernel_fields = {f.name for f in dataclasses.fields(SparsePrefillConfig)}
    assert {kernel_field(s) for s in SUFFIXES} == kernel_fields | {"dense_layers"}


def test_defaults_are_the_kernels():
    settings = settings_from_flags({})
    assert settings.kernel == SparsePrefillConfig() and settings.dense_layers == 0
    assert "--sparse-prefill-min-len=24576" in settings.describe()


@pytest.mark.parametrize("values, named", [
    ({"threshold": -1.0}, "--sparse-prefill-threshold"),
    ({"block_size": 100}, "--sparse-prefill-block-size"),
    ({"min_len": 64, "block_size": 128}, "--sparse-prefill-min-len"),
    ({"dense_layers": -2}, "--sparse-prefill-dense-layers"),
    ({"thresold": 0.1}, "--sparse-prefill-thresold"),
])  # fmt: skip
def test_invalid_values_name_the_flag(values, named):
    with pytest.raises(ValueError, match=named):
        settings_from_flags(values)


def test_changed_flags_lists_only_non_defaults():
    default = SparsePrefillConfig().threshold
    assert changed_flags({"threshold": default, "min_len": 4096}) == ["--sparse-prefill-min-len"]
    assert flag("sparse_prefill_mean_correction") == "--sparse-prefill-mean-correction"
