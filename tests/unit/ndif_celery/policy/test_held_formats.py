"""The formats a deployment may hold (``ndif_celery/policy/held_formats.py``): nnsight's own table, read without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ndif_celery.policy import held_formats


def test_the_names_are_nnsights_own_table_and_its_aliases_are_one_format():
    from nnsight.modeling.quantization import QUANTIZATIONS

    assert set(held_formats.known()) == set(held_formats.FLOATS) | set(QUANTIZATIONS)
    for name, fmt in QUANTIZATIONS.items():
        canonical = held_formats.canonical_quantization(name)
        assert QUANTIZATIONS[canonical] is fmt and canonical in held_formats.quantizations()
        assert held_formats.compute_dtype(name) == fmt.compute_dtype
    assert held_formats.canonical_quantization("int4") == held_formats.canonical_quantization("4bit") == "nf4"
    assert held_formats.canonical_quantization("8bit") == "int8"
    assert held_formats.canonical_quantization("bfloat16") is None


def test_the_web_reads_the_table_without_importing_torch():
    code = ("import sys; from ndif_celery.policy import held_formats as h; "
            "print(h.quantizations(), 'torch' in sys.modules, 'nnsight' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('nf4', 'fp4', 'int8', 'fp8') False False"


@pytest.mark.parametrize("name, kept", [("bfloat16", "bfloat16"), ("float32", "float32"), ("int4", "nf4"),
                                        ("NF4", "nf4"), ("8bit", "int8"), ("fp8", "fp8")])
def test_a_name_is_kept_as_the_farm_keys_it(name, kept):
    assert held_formats.check(name) == kept


@pytest.mark.parametrize("name", ["int3", "bfloat", "", "torch.int4x", 16])
def test_an_unknown_name_is_refused_naming_the_choices(name):
    with pytest.raises(held_formats.FormatError) as caught:
        held_formats.check(name)
    assert "not one this farm loads" in caught.value.detail and "nf4" in caught.value.detail
    assert "bfloat16" in caught.value.detail
