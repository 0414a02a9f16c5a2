"""The shared vectors of clients/testdata/function-fingerprints.json: an
idempotent function's fingerprint of each vector's arguments is the one
every client makes of them."""

import json
from pathlib import Path

import pytest

from pg_idempotency.function import arguments_fingerprint, canonical_json

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "testdata" / "function-fingerprints.json")
                     .read_text(encoding="utf-8"))["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_the_fingerprint_every_client_makes(vector):
    arguments = json.loads(vector["arguments"])
    assert canonical_json(arguments).decode() == vector["canonical"]
    assert arguments_fingerprint(arguments).hex() == vector["sha256"]


def test_what_javascript_cannot_write_is_refused():
    for value in (float("nan"), float("inf")):
        with pytest.raises(TypeError):
            canonical_json([value])
