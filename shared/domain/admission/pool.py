"""One node's dynamic KV pool, shared by the engines that have replicas there.

Each engine is guaranteed some bytes of the pool; bytes no engine is guaranteed are shared by all. A grant
comes from the engine's own guarantee first, then the shared bytes, then borrowed from idle engines'
guarantees, donors in the order MoE, transformer, SSM, hybrid (MoE lends first, as the product brief's
expert partitions do). An engine is idle, and lends, while it holds nothing and has no refused demand
waiting. When a donor's demand returns it stops lending at once; its loans are not called back (the
borrowers' requests finish) and its new grants fit its guarantee again as the borrowers release.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Final

from shared.domain.admission.engines import Engine

DONOR_ORDER: Final = (Engine.MOE, Engine.TRANSFORMER, Engine.SSM, Engine.HYBRID)
"""Whom an engine borrows from first: MoE > Transformer > SSM (the product brief), hybrid last."""


@dataclass(frozen=True, slots=True)
class Grant:
    """``nbytes`` of KV for ``engine``, of which ``borrowed`` came from other engines' guarantees.

    ``grant_id`` is the pool's: releasing the same grant twice releases it once.
    """

    engine: Engine
    nbytes: int
    borrowed: Mapping[Engine, int]
    grant_id: int = 0

    @property
    def borrowed_bytes(self) -> int:
        return sum(self.borrowed.values())


@dataclass
class _Account:
    guarantee: int
    base: int = 0  # held bytes not on loan: from its guarantee or the shared bytes
    borrowing: int = 0  # held bytes on loan from others
    lent: int = 0  # of its guarantee, bytes others hold
    waiting: bool = False  # refused while its guarantee was lent: lends nothing until served

    @property
    def held(self) -> int:
        return self.base + self.borrowing

    @property
    def idle(self) -> bool:
        return self.held == 0 and not self.waiting

    @property
    def own_room(self) -> int:
        return max(0, self.guarantee - self.lent - self.base)

    @property
    def overflow(self) -> int:
        """Base bytes beyond what its guarantee (less what it lent) covers: they sit in the shared bytes."""
        return max(0, self.base - max(0, self.guarantee - self.lent))


@dataclass
class KvPool:
    """KV bytes of one node: ``total_bytes`` in all, ``guarantees`` per engine (summing to at most the total)."""

    total_bytes: int
    guarantees: Mapping[Engine, int]
    _accounts: dict[Engine, _Account] = field(init=False, repr=False)
    _grants: dict[int, Grant] = field(init=False, repr=False, default_factory=dict)
    _next_id: int = field(init=False, repr=False, default=1)

    def __post_init__(self) -> None:
        if self.total_bytes < 0:
            raise ValueError(f"total_bytes: expected >= 0, got {self.total_bytes}")
        if any(g < 0 for g in self.guarantees.values()):
            raise ValueError(f"guarantees: expected bytes >= 0, got {dict(self.guarantees)}")
        if sum(self.guarantees.values()) > self.total_bytes:
            raise ValueError(
                f"guarantees: {sum(self.guarantees.values())} bytes in all exceed the pool's {self.total_bytes}"
            )
        self.guarantees = MappingProxyType(dict(self.guarantees))
        self._accounts = {engine: _Account(self.guarantees.get(engine, 0)) for engine in Engine}

    @classmethod
    def split(cls, total_bytes: int, engines: Iterable[Engine], shares: Mapping[Engine, float] | None = None) -> KvPool:
        """A pool whose guarantees are ``shares`` of ``total_bytes`` (fractions) for the engines present;
        present engines without a share split what the shares leave equally. Shares of engines not present
        are ignored. Bytes round down; what rounding leaves is shared."""
        present = list(dict.fromkeys(engines))
        given = {e: Fraction(s).limit_denominator(1_000_000) for e, s in (shares or {}).items() if e in present}
        if any(not 0 <= s <= 1 for s in given.values()) or sum(given.values(), Fraction(0)) > 1:
            raise ValueError(f"shares: expected fractions in [0, 1] summing to at most 1, got {dict(shares or {})}")
        rest = [e for e in present if e not in given]
        if rest:
            each = (1 - sum(given.values(), Fraction(0))) / len(rest)
            given.update(dict.fromkeys(rest, each))
        return cls(total_bytes, {e: int(total_bytes * s) for e, s in given.items()})

    def used(self, engine: Engine) -> int:
        """Bytes ``engine`` holds, borrowed ones included."""
        return self._accounts[engine].held

    def borrowed(self, engine: Engine) -> int:
        """Bytes ``engine`` holds on loan from others."""
        return self._accounts[engine].borrowing

    def lent(self, engine: Engine) -> int:
        """Bytes of ``engine``'s guarantee that others hold."""
        return self._accounts[engine].lent

    def free(self) -> int:
        return self.total_bytes - sum(a.held for a in self._accounts.values())

    def _shared_room(self) -> int:
        shared = self.total_bytes - sum(a.guarantee for a in self._accounts.values())
        return max(0, shared - sum(a.overflow for a in self._accounts.values()))

    def grant(self, engine: Engine, nbytes: int) -> Grant | None:
        """``nbytes`` for ``engine`` (own guarantee, then shared bytes, then idle donors in DONOR_ORDER),
        or None, with nothing held, when they do not add up. Never more than the pool in all."""
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
        account = self._accounts[engine]
        base = min(nbytes, account.own_room + self._shared_room())
        short = nbytes - base
        borrowed: dict[Engine, int] = {}
        for donor in DONOR_ORDER:
            if short == 0:
                break
            lender = self._accounts[donor]
            if donor is engine or not lender.idle:
                continue
            take = min(short, lender.guarantee - lender.lent)
            if take > 0:
                borrowed[donor] = take
                short -= take
        if short > 0:
            if account.lent > 0:
                account.waiting = True  # its demand is back: stop lending its guarantee
            return None
        account.base += base
        account.borrowing += nbytes - base
        if nbytes:
            account.waiting = False
        for donor, nbytes_lent in borrowed.items():
            self._accounts[donor].lent += nbytes_lent
        grant = Grant(engine=engine, nbytes=nbytes, borrowed=MappingProxyType(borrowed), grant_id=self._next_id)
        self._next_id += 1
        self._grants[grant.grant_id] = grant
        return grant

    def release(self, grant: Grant) -> None:
        """Return a grant's bytes, loans to their donors. A grant already released (or not this pool's)
        changes nothing."""
        if self._grants.pop(grant.grant_id, None) is None:
            return
        account = self._accounts[grant.engine]
        account.base -= grant.nbytes - grant.borrowed_bytes
        account.borrowing -= grant.borrowed_bytes
        for donor, nbytes in grant.borrowed.items():
            self._accounts[donor].lent -= nbytes
