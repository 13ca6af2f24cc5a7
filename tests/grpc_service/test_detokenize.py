"""Incremental detokenization and stop strings over a hand-made byte table."""

from __future__ import annotations

from tpuserve.grpc_service.detokenize import IncrementalDetokenizer

# id -> raw bytes; 0 is a special token (EOS) with no bytes.
TABLE = [
    b"",  # 0 EOS (special)
    b"he",  # 1
    b"llo",  # 2
    b" \xf0\x9f",  # 3  space + first half of U+1F600
    b"\x98\x80",  # 4  second half of U+1F600
    b" \xe4\xb8",  # 5  space + first 2 bytes of U+4E16
    b"\x96\xe7\x95\x8c",  # 6  rest of U+4E16 + U+754C
    b"\n",  # 7
    b"ST",  # 8
    b"OP",  # 9
    b"x",  # 10
    b"S",  # 11
    b"TOPy",  # 12
]
SPECIAL = {0}


def run(ids, stop=(), include=False, flush=True):
    d = IncrementalDetokenizer(TABLE, SPECIAL, stop, include)
    deltas = []
    for i in ids:
        deltas.append(d.add(i, i))
        if d.stopped:
            break
    if flush:
        deltas.append(d.flush())
    items = [x for delta in deltas for x in delta.items]
    text = "".join(delta.text for delta in deltas)
    return deltas, items, text, d


def test_plain_text_released_per_token():
    deltas, items, text, d = run([1, 2])
    assert [(x.items, x.text) for x in deltas[:2]] == [([1], "he"), ([2], "llo")]
    assert text == "hello" and items == [1, 2] and d.released_tokens == 2


def test_split_characters_wait_for_their_last_byte():
    deltas, _, text, _ = run([1, 2, 3, 4, 5, 6])
    assert text == "hello \U0001f600 \u4e16\u754c"
    assert deltas[2].items == [] and deltas[2].text == ""
    assert deltas[3].items == [3, 4] and deltas[3].text == " \U0001f600"
    assert deltas[5].items == [5, 6] and deltas[5].text == " \u4e16\u754c"
    # Each delta's token bytes are exactly its text.
    for delta in deltas:
        assert b"".join(TABLE[i] for i in delta.items) == delta.text.encode()


def test_cut_inside_a_character_keeps_the_token_not_the_half_character():
    _, items, text, d = run([1, 3])
    assert items == [1, 3] and text == "he "
    assert "\ufffd" not in text and d.released_tokens == 2


def test_special_token_has_no_text():
    _, items, text, _ = run([1, 0])
    assert items == [1, 0] and text == "he"


def test_stop_string_across_tokens_ends_text_before_it():
    deltas, items, text, d = run([1, 8, 9, 10], stop=["STOP"], flush=False)
    assert text == "he" and d.stopped == "STOP" and deltas[-1].stop == "STOP"
    # "ST" began before the stop string? No: it is the stop string's start, so neither token is kept.
    assert items == [1]
    assert d.released_tokens == 1


def test_stop_string_held_back_until_it_cannot_match():
    deltas, _, text, d = run([1, 8, 10], stop=["STOP"])
    assert deltas[1].text == "" and deltas[1].items == []  # "ST" could start "STOP"
    assert deltas[2].text == "STx" and deltas[2].items == [8, 10]
    assert d.stopped is None and text == "heSTx"


def test_token_that_began_before_the_stop_is_kept():
    # stop "STOP" begins with the token "S"; "TOPy" completes it.
    _, items, text, _ = run([10, 11, 12], stop=["STOP"], flush=False)
    assert text == "x" and items == [10]
    _, items, text, _ = run([10, 11, 12], stop=["TOP"], flush=False)
    # "TOPy" begins exactly at the stop string: dropped; "S" began before it: kept.
    assert text == "xS" and items == [10, 11]


def test_stop_string_inside_one_token_keeps_that_token():
    _, items, text, _ = run([1, 2], stop=["ll"], flush=False)
    assert text == "he" and items == [1]
    _, items, text, _ = run([1, 2], stop=["el"], flush=False)
    # "llo" completed "el" but began after its start: it contributed no text and is dropped.
    assert text == "h" and items == [1]


def test_include_stop_str():
    _, items, text, d = run([1, 8, 9, 10], stop=["STOP"], include=True, flush=False)
    assert text == "heSTOP" and items == [1, 8, 9] and d.stopped == "STOP"


def test_earliest_stop_wins():
    _, _, text, d = run([1, 2, 7], stop=["\n", "ll"], flush=False)
    assert text == "he" and d.stopped == "ll"


def test_stop_on_multibyte_text():
    _, items, text, _ = run([1, 3, 4, 10], stop=["\U0001f600"], flush=False)
    assert text == "he " and items == [1, 3]


def test_stop_token_without_text():
    d = IncrementalDetokenizer(TABLE, SPECIAL)
    d.add(1, 1)
    last = d.add(7, 7, with_text=False)
    assert last.items == [7] and last.text == ""
