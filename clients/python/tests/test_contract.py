"""The shared contract module on its own: key parsing, scope, targets,
problems, stored headers and the answers to claims."""

import hashlib
import json

import psycopg
import pytest

from pg_idempotency import Claim, Client
from pg_idempotency.contract import (InvalidKey, Options, answer_claim, credential_scope,
                                     headers_to_store, parse_key, problem, refused_key,
                                     split_target)


@pytest.mark.parametrize("field, key", [
    ('"abc"', "abc"), ("abc", "abc"), (' \t"abc" ', "abc"), ("\tabc ", "abc"),
    ('"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
    ('"a b ~!"', "a b ~!"), (r'"say \"hi\" \\"', 'say "hi" \\'), ('"()?:;,"', "()?:;,"),
    ("urn:uuid/42", "urn:uuid/42"), ("42", "42"), ("-4.5", "-4.5"), ("*tok", "*tok"),
])
def test_keys_that_parse(field, key):
    assert parse_key([field]) == key


@pytest.mark.parametrize("field", [
    '"abc', '"abc" x', '"abc";x=1', '"a\\qb"', '"a\\"', '"é"', '"\x7f"', '"a\tb"', '?1',
    ':YWJj:', '(a b)', '""', '', '   ', '"a", "b"', "a,b", "a b", "a;b", "a\x00", "é", "x" * 256,
    '"' + "x" * 256 + '"'])
def test_keys_that_do_not(field):
    with pytest.raises(InvalidKey) as error:
        parse_key([field])
    assert str(error.value).startswith("The Idempotency-Key")


def test_no_field_is_no_key_and_two_fields_are_invalid():
    assert parse_key([]) is None
    with pytest.raises(InvalidKey):
        parse_key(["a", "a"])


def test_the_scope_hashes_authorization_first_then_x_api_key():
    sha = lambda text: hashlib.sha256(text).hexdigest()  # noqa: E731
    assert credential_scope([("x-api-key", b"k"), ("authorization", b"Bearer t")]) == sha(b"authorization:Bearer t")
    assert credential_scope([("x-api-key", b"k\xe9")]) == sha(b"x-api-key:k\xe9")
    assert credential_scope([("accept", b"*/*")]) == ""


@pytest.mark.parametrize("target, path, query", [
    (b"/p?a=1", b"/p", b"a=1"), (b"/p", b"/p", None), (b"/p?", b"/p", b""),
    (b"/a%2Fb?x?y", b"/a%2Fb", b"x?y"), (b"http://host:8/p/q?z", b"/p/q", b"z"),
    (b"http://host", b"/", None), (b"//double/slash", b"//double/slash", None)])
def test_split_target(target, path, query):
    assert split_target(target) == (path, query)


def test_a_problem_is_rfc_9457_with_the_code():
    answer = problem("idempotency_key_in_progress", retry_after=0)
    assert answer.status == 409
    assert dict(answer.headers) == {"Content-Type": "application/problem+json", "Retry-After": "1"}
    assert json.loads(answer.body) == {
        "type": "about:blank", "title": "Conflict", "status": 409, "code": "idempotency_key_in_progress",
        "detail": "A request with this Idempotency-Key is still running; retry later."}
    assert json.loads(problem("idempotency_key_mismatch").body)["title"] == "Unprocessable Content"


def test_headers_to_store_match_names_in_any_case_and_keep_repeats():
    options = Options(store_headers=["content-type", "LINK"])
    headers = [("Content-Type", "text/plain"), ("Link", "<a>"), ("link", "<b>"), ("Link", "<c>"),
               ("Set-Cookie", "s=1")]
    assert headers_to_store(headers, options) == {"Content-Type": "text/plain",
                                                  "Link": ["<a>", "<b>", "<c>"]}


def claim(outcome, **fields):
    """A Claim with every other field empty."""
    empty = dict.fromkeys(Claim.__dataclass_fields__)
    return Claim(**{**empty, "outcome": outcome, **fields})


def test_the_answers_to_claims():
    assert answer_claim(claim("new", fence=1)) is None
    replay = answer_claim(claim("replay", status_code=201, body=b"\x00x",
                                headers={"Content-Type": "a/b", "Link": ["<1>", "<2>"]}))
    assert replay == (201, [("Content-Type", "a/b"), ("Link", "<1>"), ("Link", "<2>"),
                            ("Idempotent-Replayed", "true")], b"\x00x")
    busy = answer_claim(claim("in_progress", retry_after=17))
    assert busy.status == 409 and ("Retry-After", "17") in busy.headers
    assert answer_claim(claim("mismatch")).status == 422
    with pytest.raises(ValueError):
        answer_claim(claim("maybe"))


def test_only_a_key_the_extension_refuses_is_the_clients_fault(pool):
    client = Client(pool)
    with pytest.raises(psycopg.Error) as bad_key:
        client.claim("k\x01", b"f")
    assert refused_key(bad_key.value).status == 400
    with pytest.raises(psycopg.Error) as bad_scope:
        client.claim("k", b"f", scope="s" * 300)
    with pytest.raises(psycopg.Error) as bad_lease:
        client.claim("k", b"f", lease="-1 second")
    assert refused_key(bad_scope.value) is None and refused_key(bad_lease.value) is None


def test_unknown_options_are_refused():
    with pytest.raises(TypeError):
        Options(leese="1 second")
