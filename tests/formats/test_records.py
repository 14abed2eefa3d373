"""Records: packed ids parsed straight from JSON, splits found on packed ids."""

import random

import msgspec
import numpy as np
import pytest

from toolkit.formats.records import id_positions, ids_from_json, pack_ids, split_output


def test_ids_from_json_matches_a_json_decoder():
    rng = random.Random(3)
    for n in (0, 1, 2, 17, 4096):
        ids = [rng.randrange(0, 200_000) for _ in range(n)]
        for raw in (
            msgspec.json.encode(ids),
            ("[" + ", ".join(map(str, ids)) + "]").encode(),
            b" \n" + msgspec.json.encode(ids),
        ):
            assert ids_from_json(raw).tolist() == ids
            assert ids_from_json(raw, n).tolist() == ids
            with pytest.raises(ValueError):
                ids_from_json(raw, n + 1)


@pytest.mark.parametrize(
    "raw", [b"[1,2.5,3]", b"[-1,2]", b"[1,,2]", b'[1,"a"]', b"{}", b"[1e3,2]", b"[1,2"]
)
def test_ids_from_json_rejects_what_is_not_token_ids(raw):
    with pytest.raises(ValueError):
        ids_from_json(raw, 3 if raw.count(b",") == 2 else 2)


def test_positions_are_token_aligned():
    # 0x0100 followed by 0x0000 contains the bytes of 1 at an unaligned offset: it must not match.
    packed = pack_ids([256, 0, 7, 1, 9])
    assert id_positions(packed, 1) == 3
    assert id_positions(packed, 7) == 2 and id_positions(packed, 8) is None
    arr = np.frombuffer(packed, "<u4")
    assert split_output(arr, 7, 9) == (2, 4)
    assert split_output(arr, 5, None) == (None, None)


def test_records_written_before_failure_kinds_still_decode():
    from toolkit.formats.records import TRANSIENT, Record, failed_record, is_transient

    old = [
        "p1",
        "d",
        0,
        "failed",
        b"",
        b"",
        None,
        None,
        None,
        None,
        3,
        0,
        0,
        0.0,
        2,
        "HTTP 503: busy",
    ]  # 16 fields
    r = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=Record)
    assert r.failure is None and r.error == "HTTP 503: busy" and not is_transient(r)
    assert TRANSIENT == {
        "timeout",
        "server_error",
        "unreachable",
        "bad_response",
        "aborted",
        "nan",
        "partial",
        "previous_turn",
    }
    assert r.segments == 1
    assert is_transient(failed_record("p", "d", 0, [1], "no answer within 1 s", 2, "timeout"))
    assert not is_transient(failed_record("p", "d", 0, [1], "HTTP 400: too long", 1, "rejected"))


def test_last_meaningful_reads_packed_ids_and_lists_alike():
    from toolkit.formats.records import last_meaningful

    blank = frozenset({9, 10})
    for ids in ([1, 2, 7, 9, 10], [7], [3, 7, 10, 10, 10]):
        assert last_meaningful(ids, blank) == last_meaningful(pack_ids(ids), blank) == 7
    for nothing in ([], [9, 10, 9]):
        assert (
            last_meaningful(nothing, blank) is None
            and last_meaningful(pack_ids(nothing), blank) is None
        )
    assert last_meaningful(pack_ids([70000, 2**32 - 1, 9]), blank) == 2**32 - 1


def test_records_written_before_tries_were_counted_decode_as_one_try_not_final(tmp_path):
    """A record without `tries` and `final` (written before failures that may pass were bounded) counts as one failed
    try, still transient: the next run goes on counting from it. A final one is a failure, not transient, and the
    done manifest counts it apart (`given_up`)."""
    from toolkit.formats.manifests import write_done
    from toolkit.formats.records import Record, failed_record, is_given_up, is_transient
    from toolkit.formats.shardfile import ShardWriter

    old = [
        "p1",
        "d",
        0,
        "failed",
        b"",
        b"",
        None,
        None,
        None,
        None,
        3,
        0,
        0,
        0.0,
        2,
        "timed out",
        "timeout",
        1,
    ]
    r = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=Record)
    assert (r.tries, r.final) == (1, False) and is_transient(r) and not is_given_up(r)

    path = tmp_path / "00000.zst"
    w = ShardWriter(path, "f" * 16, 0)
    w.open(range(2))
    again = failed_record(
        "p1", "d", 0, [1], "failed 3 times: timeout; last: ...", 2, "timeout", final=True
    )
    again.tries = 3
    later = failed_record("p2", "d", 1, [1], "no answer", 2, "timeout")
    later.tries = 2
    for rec in (r, failed_record("p2", "d", 1, [1], "no answer", 2, "timeout"), again, later):
        w.add(rec)
    w.close()
    assert is_given_up(again) and not is_transient(again)
    w = ShardWriter(path, "f" * 16, 0)
    found = w.open(range(2))
    assert found.transient == {"p2"} and found.tries == {
        "p2": 2
    }  # the newest record of each id counts
    w.close()
    m = write_done(tmp_path / "00000.done", path, 0, "f" * 16, positions=range(0, 2))
    assert (m.records, m.failed, m.transient, m.given_up, m.superseded) == (2, 2, 1, 1, 2)
