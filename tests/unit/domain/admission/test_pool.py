"""A node's KV pool: guarantees hold, idle guarantees are lent in donor order, never past the total, and
a donor whose demand returns gets its guarantee back as borrowers release."""

from __future__ import annotations

import pytest

from shared.domain.admission import DONOR_ORDER, Engine, Grant, KvPool

E = Engine
G = 1024**3  # a GiB


def test_donor_order_is_moe_transformer_ssm_hybrid() -> None:
    assert DONOR_ORDER == (E.MOE, E.TRANSFORMER, E.SSM, E.HYBRID)


@pytest.mark.parametrize(
    ("total", "engines", "shares", "guarantees"),
    [
        (90 * G, [E.TRANSFORMER, E.SSM, E.MOE], None, {E.TRANSFORMER: 30 * G, E.SSM: 30 * G, E.MOE: 30 * G}),
        (100, [E.TRANSFORMER, E.SSM, E.MOE], None, {E.TRANSFORMER: 33, E.SSM: 33, E.MOE: 33}),  # 1 byte shared
        (100, [E.SSM, E.SSM], None, {E.SSM: 100}),  # an engine named twice is one engine
        # MoE half; the other two split the other half
        (100 * G, [E.TRANSFORMER, E.SSM, E.MOE], {E.MOE: 0.5}, {E.TRANSFORMER: 25 * G, E.SSM: 25 * G, E.MOE: 50 * G}),
        # the hybrid is not on this node: its share is ignored
        (100, [E.TRANSFORMER], {E.TRANSFORMER: 0.25, E.HYBRID: 0.5}, {E.TRANSFORMER: 25}),  # 75 bytes shared
    ],
)
def test_split(
    total: int, engines: list[Engine], shares: dict[Engine, float] | None, guarantees: dict[Engine, int]
) -> None:
    assert dict(KvPool.split(total, engines, shares).guarantees) == guarantees


@pytest.mark.parametrize(
    "shares",
    [{E.MOE: 1.5}, {E.MOE: -0.1}, {E.MOE: 0.6, E.SSM: 0.6}],
)
def test_split_refuses_shares_that_are_not_fractions_of_the_pool(shares: dict[Engine, float]) -> None:
    with pytest.raises(ValueError, match="shares"):
        KvPool.split(100, [E.MOE, E.SSM], shares)


def test_guarantees_may_not_exceed_the_pool() -> None:
    with pytest.raises(ValueError, match="exceed"):
        KvPool(100, {E.MOE: 60, E.SSM: 41})


def test_a_guarantee_is_honoured_while_others_are_busy() -> None:
    pool = KvPool.split(90 * G, [E.TRANSFORMER, E.SSM, E.MOE])  # 30 GiB each
    assert pool.grant(E.SSM, 1 * G) and pool.grant(E.MOE, 1 * G)  # both busy: neither lends
    assert pool.grant(E.TRANSFORMER, 30 * G) is not None
    assert pool.grant(E.TRANSFORMER, 1) is None  # its guarantee is spent and nobody is idle
    assert pool.grant(E.SSM, 29 * G) is not None  # the others still have all of theirs
    assert pool.grant(E.MOE, 29 * G) is not None
    assert pool.free() == 0


def test_borrowing_from_idle_engines_in_donor_order() -> None:
    pool = KvPool.split(100 * G, [E.TRANSFORMER, E.SSM, E.MOE, E.HYBRID])  # 25 GiB each, all idle
    grant = pool.grant(E.HYBRID, 55 * G)
    assert grant is not None
    # its own 25, then MoE's 25, then the transformer's 5; SSM (next in order) is not needed
    assert dict(grant.borrowed) == {E.MOE: 25 * G, E.TRANSFORMER: 5 * G}
    assert pool.used(E.HYBRID) == 55 * G and pool.borrowed(E.HYBRID) == 30 * G
    assert pool.lent(E.MOE) == 25 * G and pool.lent(E.TRANSFORMER) == 5 * G and pool.lent(E.SSM) == 0
    # the SSM borrows what is left: the transformer's 20 (MoE's is gone), the hybrid holds (is busy)
    more = pool.grant(E.SSM, 45 * G)
    assert more is not None and dict(more.borrowed) == {E.TRANSFORMER: 20 * G}
    assert pool.free() == 0


def test_a_busy_engine_lends_nothing_even_with_room_in_its_guarantee() -> None:
    pool = KvPool.split(100 * G, [E.TRANSFORMER, E.MOE])  # 50 each
    assert pool.grant(E.MOE, 1) is not None
    assert pool.grant(E.TRANSFORMER, 51 * G) is None
    assert pool.used(E.TRANSFORMER) == 0  # a refusal holds nothing


def test_no_borrowing_beyond_the_total() -> None:
    pool = KvPool.split(60 * G, [E.TRANSFORMER, E.SSM, E.MOE])  # 20 each
    assert pool.grant(E.TRANSFORMER, 61 * G) is None  # more than the pool
    grant = pool.grant(E.TRANSFORMER, 60 * G)  # all of it: its 20, MoE's 20, SSM's 20
    assert grant is not None and dict(grant.borrowed) == {E.MOE: 20 * G, E.SSM: 20 * G}
    assert pool.free() == 0
    assert pool.grant(E.TRANSFORMER, 1) is None
    assert pool.grant(E.MOE, 1) is None  # its guarantee is lent out: it waits for the borrower


def test_shared_bytes_come_before_borrowing() -> None:
    pool = KvPool.split(100 * G, [E.TRANSFORMER, E.SSM], {E.TRANSFORMER: 0.25, E.SSM: 0.25})  # 50 shared
    grant = pool.grant(E.TRANSFORMER, 75 * G)
    assert grant is not None and grant.borrowed_bytes == 0  # 25 own + 50 shared
    loan = pool.grant(E.TRANSFORMER, 25 * G)
    assert loan is not None and dict(loan.borrowed) == {E.SSM: 25 * G}
    assert pool.free() == 0


def test_a_returning_donor_gets_its_guarantee_back_once_borrowers_release() -> None:
    pool = KvPool.split(100 * G, [E.TRANSFORMER, E.MOE])  # 50 each
    own = pool.grant(E.TRANSFORMER, 50 * G)
    loan = pool.grant(E.TRANSFORMER, 40 * G)  # MoE is idle: lent
    assert own is not None and loan is not None and dict(loan.borrowed) == {E.MOE: 40 * G}

    # MoE's demand returns: 10 GiB of its own still fit, 20 do not while 40 are lent
    assert pool.grant(E.MOE, 20 * G) is None
    assert pool.used(E.TRANSFORMER) == 90 * G  # the borrower is not evicted
    # and from now on MoE lends nothing new, even the 10 GiB still free in its guarantee
    assert pool.grant(E.TRANSFORMER, 5 * G) is None

    pool.release(loan)  # the borrower's requests finish
    assert pool.grant(E.TRANSFORMER, 5 * G) is None  # MoE is still owed: no new loan
    back = pool.grant(E.MOE, 50 * G)  # its whole guarantee
    assert back is not None and back.borrowed_bytes == 0
    pool.release(back)  # MoE idle again: it lends again
    again = pool.grant(E.TRANSFORMER, 5 * G)
    assert again is not None and dict(again.borrowed) == {E.MOE: 5 * G}


def test_release_is_idempotent_and_ignores_foreign_grants() -> None:
    pool = KvPool.split(100, [E.TRANSFORMER, E.MOE])
    grant = pool.grant(E.TRANSFORMER, 70)
    assert grant is not None
    pool.release(grant)
    pool.release(grant)
    pool.release(Grant(engine=E.TRANSFORMER, nbytes=70, borrowed={}))  # not this pool's
    assert pool.used(E.TRANSFORMER) == 0 and pool.lent(E.MOE) == 0 and pool.free() == 100


def test_a_zero_byte_grant_holds_nothing_and_negative_is_an_error() -> None:
    pool = KvPool.split(100, [E.SSM])
    grant = pool.grant(E.SSM, 0)
    assert grant is not None and grant.nbytes == 0 and pool.free() == 100
    with pytest.raises(ValueError, match="nbytes"):
        pool.grant(E.SSM, -1)
