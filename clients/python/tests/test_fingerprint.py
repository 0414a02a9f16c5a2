"""fingerprint() in Python equals idempotency.fingerprint() in the database."""

import os

import pytest

from pg_idempotency import fingerprint

CASES = [
    ("POST", "/payments", None, None),
    ("POST", "/payments", b"", ""),                  # empty, not absent
    ("post", "/payments", b'{"amount":10}', None),   # method case
    ("PaTcH", "/p", b"\x00\x01\xfe\xff", "a=1&b=%20"),  # binary body
    ("pöst", "/ünïcode/路径", "é".encode(), "q=ü"),   # non-ASCII: UTF-8, ASCII-only upper case
    ("a", "bc", None, None),                         # no two splits share an encoding
    ("ab", "c", None, None),
    ("POST", "/big", os.urandom(1 << 20), "x" * 5000),
]


@pytest.mark.parametrize("method, path, body, query", CASES,
                         ids=[f"case{i}" for i in range(len(CASES))])
def test_equals_the_databases(admin, method, path, body, query):
    expected = admin.execute("SELECT idempotency.fingerprint(%s, %s, %s, %s)",
                             (method, path, body, query)).fetchone()[0]
    assert fingerprint(method, path, body, query) == expected
    assert fingerprint(method, path.encode(), body, None if query is None else query.encode()) == expected


def test_absent_and_empty_parts_differ():
    prints = {fingerprint("POST", "/p", None, None), fingerprint("POST", "/p", b"", None),
              fingerprint("POST", "/p", None, ""), fingerprint("POST", "/p", b"", "")}
    assert len(prints) == 4


def test_a_missing_method_or_path_is_an_error():
    with pytest.raises(TypeError):
        fingerprint(None, "/p")
    with pytest.raises(TypeError):
        fingerprint("POST", None)
