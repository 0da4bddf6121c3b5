"""``core/serving/redact.py``: a secret of every kind the gateway handles, embedded anywhere in any
text, never survives ``redact``; and what a client reads of a start's progress is a phrase
of a fixed vocabulary (``core/controller.public_progress``)."""

from __future__ import annotations

import secrets
import string

from hypothesis import assume, given
from hypothesis import strategies as st

from llmgw_cli.core.planning.controller import public_progress
from llmgw_cli.core.serving.redact import MASK, redact

URLSAFE = string.ascii_letters + string.digits + "-_"
HEX = "0123456789abcdef"


def _token(alphabet: str, size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet, min_size=size, max_size=size)


# Each: (a secret as the gateway makes it, the text that carries it).
PEER = _token(URLSAFE, 32).map(lambda s: (s, f"http://10.0.0.2:8123/{s}/model-00001-of-00004.safetensors"))
ENGINE_KEY = _token(HEX, 64).map(lambda k: (k, k))
HF = _token(string.ascii_letters, 34).map(lambda t: (f"hf_{t}", f"hf_{t}"))
API_KEY = _token(URLSAFE, 43).map(lambda t: (f"llmgw-{t}", f"llmgw-{t}"))
BEARER = _token(URLSAFE, 20).map(lambda t: (t, f"Authorization: Bearer {t}"))
USERINFO = _token(URLSAFE, 12).map(lambda p: (p, f"https://user:{p}@hub.example/org/name"))
ENV = st.tuples(
    st.sampled_from(["HF_TOKEN", "LLMGW_ENGINE_KEY", "VLLM_API_KEY", "MY_SECRET", "DB_PASSWORD"]),
    st.sampled_from(["=", ": ", "="]),
    _token(URLSAFE, 12),
).map(lambda t: (t[2], f"{t[0]}{t[1]}{t[2]}"))
FLAG = _token(URLSAFE, 12).map(lambda v: (v, f"vllm serve org/m --api-key {v} --port 8100"))
JSON = _token(URLSAFE, 12).map(lambda v: (v, f'{{"secret": "{v}", "folder": 3}}'))
SECRETS = st.one_of(PEER, ENGINE_KEY, HF, API_KEY, BEARER, USERINFO, ENV, FLAG, JSON)
# What surrounds it: anything a node, an engine or a journal may print, glued on or not.
AROUND = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@given(SECRETS, AROUND, AROUND)
def test_a_secret_anywhere_in_any_text_never_survives(
    secret: tuple[str, str], before: str, after: str
) -> None:
    value, carrier = secret
    # the same characters said elsewhere (a variable's name) are not the secret
    assume(value not in before + after and carrier.count(value) == 1)
    assert value not in redact(before + carrier + after)


@given(SECRETS, st.lists(AROUND, min_size=1, max_size=4))
def test_a_secret_said_many_times_among_other_lines_never_survives(
    secret: tuple[str, str], lines: list[str]
) -> None:
    value, carrier = secret
    assume(not any(value in line for line in lines) and carrier.count(value) == 1)
    text = f"\n{carrier}\n".join(lines)
    assert value not in redact(text + carrier)


@given(_token(URLSAFE, 10), AROUND, AROUND)
def test_a_known_secret_goes_whatever_its_shape(key: str, before: str, after: str) -> None:
    assume(key not in before + after)
    assert key not in redact(before + key + after, known=[key])


def test_a_start_failure_keeps_what_the_operator_needs() -> None:
    peer = secrets.token_urlsafe(24)
    key = secrets.token_hex(32)
    text = (
        f"llmgw-m-0.service failed (exit-code)\nhttp://10.0.0.2:8123/{peer}/w.bin answered 403 Forbidden\n"
        f"vllm serve org/m --api-key {key}\nValueError: no such model"
    )
    out = redact(text)
    assert peer not in out and key not in out
    assert f"http://10.0.0.2:8123/{MASK}/w.bin answered 403 Forbidden" in out
    assert "llmgw-m-0.service failed (exit-code)" in out and "ValueError: no such model" in out
    # a commit, a model's name and a fetch's numbers are not secrets
    kept = "Meta-Llama-3-70B-Instruct at 0123456789abcdef0123456789abcdef01234567: 3/9 files"
    assert redact(kept) == kept


def test_short_known_values_are_not_looked_for() -> None:
    assert redact("the engine is ready", known=["", "e"]) == "the engine is ready"


def test_a_client_reads_a_fixed_phrase_of_a_starts_progress() -> None:
    peer = secrets.token_urlsafe(24)
    fetching = f"m@a: fetching 12/40 files, 3.0 of 9.0 GB from peer http://10.0.0.2:8123/{peer}/: slow"
    assert public_progress(fetching) == "fetching weights: 12/40 files, 3.0 of 9.0 GB"
    assert public_progress("m@a: fetching 512 of 810 MB from origin") == "fetching weights: 512 of 810 MB"
    assert public_progress("m@a: waiting from origin: another fetch holds the lock") == "waiting for weights"
    assert public_progress("m@a: weights failed from origin: /secret/path") == "fetching weights"
    assert public_progress("probing the nodes to place a replica") == "placing a replica"
    assert public_progress("starting on a,b") == "starting the engine"
    assert public_progress("engine loading") == "engine loading"
    assert public_progress(f"anything else {peer}") == "starting"
    assert public_progress("") == ""


@given(st.text(max_size=200))
def test_public_progress_says_only_its_vocabulary_and_numbers(text: str) -> None:
    said = public_progress(text)
    words = said.replace(",", " ").replace(":", " ").split()
    vocabulary = {"fetching", "weights", "waiting", "for", "placing", "a", "replica", "starting", "the"}
    vocabulary |= {"engine", "loading", "files", "of", "GB", "MB"}
    assert all(w in vocabulary or set(w) <= set("0123456789./") for w in words), said
