import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_bridge.cache.hashing import (
    ROOT_SEED,
    chain_root,
    checkpoint_key,
    encode_extra_keys,
    hash_block,
    hash_chain,
    pack_tokens,
)

EXTRA = (("model", "fp-1"), ("tenant", b"salt-a"))

# Pins the byte layout: if this changes, caches persisted by older versions would be read
# under a different meaning. Change ROOT_SEED's version together with it.
GOLDEN_LAST = "020262a840fb1d2bb74f1e291796cd44bfa9ecf38cda426e04dfe4b4fca1736d"


def test_chain_layout_matches_pinned_digest():
    assert hash_chain(range(128), 64, (("model", "m"),))[-1].hex() == GOLDEN_LAST


def test_chain_is_identical_in_another_process():
    code = (
        "from engine_bridge.cache.hashing import hash_chain;"
        "print(','.join(h.hex() for h in hash_chain(range(300), 64,"
        " (('model', 'fp-1'), ('tenant', b'salt-a')))))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.strip()
    assert out.split(",") == [h.hex() for h in hash_chain(range(300), 64, EXTRA)]


def test_chain_has_one_hash_per_full_block():
    assert len(hash_chain(range(63), 64)) == 0
    assert len(hash_chain(range(64), 64)) == 1
    assert len(hash_chain(range(130), 64)) == 2
    assert len(hash_chain(range(10), 4)) == 2


def test_shared_prefix_gives_shared_chain():
    a = list(range(200))
    b = a[:150] + [7] * 100
    ha, hb = hash_chain(a, 64, EXTRA), hash_chain(b, 64, EXTRA)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]


def test_extra_keys_enter_through_first_block_only():
    tokens = list(range(256))
    chain = hash_chain(tokens, 64, EXTRA)
    assert chain[0] == hash_block(chain_root(EXTRA), tokens[:64])
    assert chain_root(EXTRA) == hash_block(ROOT_SEED, (), encode_extra_keys(EXTRA))
    for i in range(1, 4):
        assert chain[i] == hash_block(chain[i - 1], tokens[i * 64 : (i + 1) * 64])


def test_different_extra_keys_share_no_block():
    tokens = list(range(256))
    a = hash_chain(tokens, 64, (("tenant", "a"),))
    b = hash_chain(tokens, 64, (("tenant", "b"),))
    none = hash_chain(tokens, 64)
    assert not set(a) & set(b)
    assert not set(a) & set(none)


def test_tag_order_is_canonical_but_repeated_tags_keep_order():
    assert encode_extra_keys((("model", "m"), ("tenant", "t"))) == encode_extra_keys(
        (("tenant", "t"), ("model", "m"))
    )
    assert encode_extra_keys((("mm", b"x"), ("mm", b"y"))) != encode_extra_keys(
        (("mm", b"y"), ("mm", b"x"))
    )


def test_extra_key_encoding_is_unambiguous():
    assert encode_extra_keys((("t", "ab"),)) != encode_extra_keys((("t", b"ab"),))
    assert encode_extra_keys((("a", "bc"),)) != encode_extra_keys((("ab", "c"),))
    assert encode_extra_keys((("a", "b"), ("c", "d"))) != encode_extra_keys((("a", "bcd"),))
    assert encode_extra_keys(()) != encode_extra_keys((("", ""),))


def test_token_bytes_cannot_pose_as_extra_bytes():
    parent = ROOT_SEED
    assert hash_block(parent, [0x04030201]) != hash_block(parent, [], b"\x01\x02\x03\x04")
    assert hash_block(parent, [1, 2]) != hash_block(parent, [1], pack_tokens([2]))


def test_tokens_pack_as_little_endian_uint32():
    assert pack_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_id_outside_uint32_is_rejected(bad):
    with pytest.raises(OverflowError):
        hash_chain([bad] * 4, 4)


def test_checkpoint_key_is_not_a_block_hash():
    tokens = list(range(64))
    assert checkpoint_key(ROOT_SEED, tokens) != hash_block(ROOT_SEED, tokens)
