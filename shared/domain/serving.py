"""One simulated engine replica serving requests: the arithmetic behind `hetsched.engines.sim_server`.

Nothing here reads a clock or does IO; the server hands in the (simulated) time in seconds and sleeps
the durations this module returns.

**Profile** (`engine_profile`): what a replica of a catalog model on ``tp`` accelerators of a SKU holds.

* Load time: the weights one accelerator holds over its PCIe host link, as placement estimates it
  (`shared.domain.placement.ladder.weight_load_s`, the figure behind ``Estimate.load_time_s``).
* KV capacity in tokens: the usable HBM of one accelerator (``usable_hbm``: HBM x the utilisation
  ceiling) minus what the memory model puts there besides the KV cache (weights, activation peak of a
  full step, workspace), divided by the KV bytes one token adds on the fullest rank.

**Continuous batching** (`Batcher`), as vLLM's scheduler works to first order:

* Requests wait in arrival order. Before each step the scheduler admits waiting requests while fewer
  than ``max_num_seqs`` run, the prompts admitted in this step stay within ``max_num_batched_tokens``
  (the first one always goes), and the request's whole context (prompt + max_tokens) fits in the KV
  capacity beside the whole contexts of those running. Reserving the whole context up front means no
  request is ever preempted (vLLM allocates as it goes and preempts instead; the peak use is the same).
* A step prefills the prompts admitted in it (one ``latency.prefill_ms`` of their uncached tokens
  together) and decodes one token for every request prefilled before (one ``latency.decode_step_ms``
  at that batch size and the batch's mean context); its time is the sum of the two. At its end every
  request in it has one more token: a prefilled request its first, a decoding one its next.
* A request is done after ``max_tokens`` tokens (finish reason ``length``: the filler text never stops).
* KV use is the tokens held (prompt + generated of every running request) over the capacity.
* Prefix cache: a prompt is cut into blocks of ``BLOCK_CHARS`` characters, each keyed by a hash of the
  prompt up to its end; the leading blocks whose keys were seen before are hits and are not prefilled
  again (the last token always is). Keys are kept least-recently-used first, as many as the KV
  capacity holds blocks. Queries and hits are counted in tokens, as vLLM counts them.

Prompt tokens are counted as characters / 4 (rounded up, at least 1): the rule of thumb for English
text under BPE tokenizers, so no tokenizer is needed.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from shared.domain.hardware import Sku
from shared.domain.latency import ModelShape, calibration_for, decode_step_ms, prefill_ms
from shared.domain.memory import (
    DEFAULT_CEILING,
    DEFAULT_TOKENS_IN_FLIGHT,
    kv_cache_bytes,
    per_accelerator_share,
    usable_hbm,
)
from shared.domain.models import ModelSpec
from shared.domain.placement.ladder import weight_load_s
from shared.domain.placement.perf import model_shape

CHARS_PER_TOKEN: Final = 4
BLOCK_CHARS: Final = 64  # a prefix-cache block: 16 tokens at CHARS_PER_TOKEN, vLLM's default block size
BLOCK_TOKENS: Final = BLOCK_CHARS // CHARS_PER_TOKEN
DEFAULT_MAX_NUM_SEQS: Final = 256  # vLLM's default --max-num-seqs
FINISH_LENGTH: Final = "length"

# Filler vocabulary: common English words, so replies read as text and count one token each.
WORDS: Final = (
    "the of and to in is it that for on with as was at by this be from are or an have not which one all "
    "were they but can has more when there will their if about into time some would other only what so "
    "its also two than them first then these may like such over well where most new used through after "
    "between each many made could because both under while three same any those work part during before"
).split()


# ---------------------------------------------------------------------------------------------
# Text


def count_prompt_tokens(text: str) -> int:
    """Tokens a prompt of ``text`` counts as: characters / 4, rounded up, at least 1."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def text_seed(text: str) -> int:
    """A stable number from ``text`` (the same on every run and machine) to start the filler from."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def filler_token(seed: int, index: int) -> str:
    """The ``index``-th token of the reply to a prompt of ``seed``: a word with a leading space."""
    return " " + WORDS[(seed + 7 * index) % len(WORDS)]


def prefix_block_keys(text: str) -> tuple[str, ...]:
    """One key per whole ``BLOCK_CHARS`` block of ``text``: a hash chained over the blocks up to its end."""
    keys: list[str] = []
    previous = b""
    for end in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS):
        previous = hashlib.sha256(previous + text[end - BLOCK_CHARS : end].encode()).digest()
        keys.append(previous.hex())
    return tuple(keys)


# ---------------------------------------------------------------------------------------------
# Profile


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """A replica of ``shape`` on ``tp`` accelerators of ``sku``: its load time and its KV pool."""

    shape: ModelShape
    sku: Sku
    tp: int
    weight_bytes_per_accelerator: int
    load_s: float
    kv_bytes_per_token: int  # on the fullest rank
    kv_capacity_tokens: int
    max_model_len: int

    def prefill_s(self, tokens: int) -> float:
        return prefill_ms(self.shape, self.sku, self.tp, tokens) / 1e3

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        return decode_step_ms(self.shape, self.sku, self.tp, batch, context_tokens) / 1e3


def engine_profile(
    spec: ModelSpec,
    sku: Sku,
    *,
    tp: int,
    dtype: str,
    kv_dtype: str,
    ceiling: float = DEFAULT_CEILING,
    max_num_batched_tokens: int = DEFAULT_TOKENS_IN_FLIGHT,
    max_model_len: int | None = None,
) -> EngineProfile:
    """The profile of ``spec`` on ``tp`` x ``sku``; ValueError when its weights leave no room for KV, or
    when the latency model has no calibration for the SKU's family."""
    calibration_for(sku)  # fail at start, not at the first request
    fixed = per_accelerator_share(
        spec,
        tp=tp,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context_tokens=1,
        concurrency=0,
        tokens_in_flight=max_num_batched_tokens,
    )
    free = usable_hbm(sku.hbm_bytes, ceiling) - fixed.total
    if free <= 0:
        raise ValueError(
            f"{spec.name} ({dtype}) at tp={tp} does not fit {sku.name}: weights, activation and workspace take "
            f"{fixed.total / 1e9:.1f} GB of {usable_hbm(sku.hbm_bytes, ceiling) / 1e9:.1f} GB usable per accelerator"
        )
    per_token = kv_cache_bytes(spec, seq_len=1, batch=1, kv_dtype=kv_dtype, tp=tp)
    # A model without attention (pure SSM) holds no per-token KV: only max_model_len bounds a sequence.
    capacity = free // per_token if per_token else spec.max_context * DEFAULT_MAX_NUM_SEQS
    return EngineProfile(
        shape=model_shape(spec, dtype, kv_dtype),
        sku=sku,
        tp=tp,
        weight_bytes_per_accelerator=fixed.weights,
        load_s=weight_load_s(fixed.weights, sku),
        kv_bytes_per_token=per_token,
        kv_capacity_tokens=capacity,
        max_model_len=min(max_model_len or spec.max_context, spec.max_context),
    )


# ---------------------------------------------------------------------------------------------
# Continuous batching


@dataclass(frozen=True, slots=True)
class Token:
    """One token a step produced for ``request_id``: its position in the reply, and whether it is the last."""

    request_id: str
    index: int
    finished: bool


@dataclass(frozen=True, slots=True)
class Finished:
    """A finished request's figures (seconds, simulated), the ones vLLM's per-request histograms take."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    e2e_s: float
    queued_s: float
    prefill_s: float
    decode_s: float
    inference_s: float
    mean_time_per_output_token_s: float


@dataclass(frozen=True, slots=True)
class Step:
    """What one engine step runs: the requests it prefills and those it decodes, from ``start_s`` for
    ``duration_s``; ``prefix_queries`` / ``prefix_hits`` are the admitted prompts' tokens and cached ones."""

    start_s: float
    duration_s: float
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    prompt_tokens: int
    prefix_queries: int
    prefix_hits: int

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step produced: tokens, the tokens counted (prompt, generation), each first token's TTFT,
    the inter-token latencies, and the requests it finished."""

    tokens: tuple[Token, ...]
    prompt_tokens: int
    generation_tokens: int
    time_to_first_token_s: tuple[float, ...]
    inter_token_latency_s: tuple[float, ...]
    finished: tuple[Finished, ...]


@dataclass(slots=True)
class _Sequence:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    block_keys: tuple[str, ...]
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    generated: int = 0

    @property
    def reserved(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def held(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class Batcher:
    """The scheduler of one replica (module docstring). Drive it with `submit`, then `plan` a step, wait
    its ``duration_s``, and `complete` it; `plan` returns None when nothing runs or waits."""

    profile: EngineProfile
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_TOKENS_IN_FLIGHT
    _waiting: deque[_Sequence] = field(default_factory=deque)
    _running: dict[str, _Sequence] = field(default_factory=dict)
    _prefix: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _pending: Step | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    # -- state ------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Share of the KV capacity the running requests hold now (0..1)."""
        held = sum(seq.held for seq in self._running.values())
        return min(1.0, held / self.profile.kv_capacity_tokens) if self.profile.kv_capacity_tokens else 0.0

    def refusal(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size can never run here (in words), or None when it can."""
        total = prompt_tokens + max_tokens
        if total > self.profile.max_model_len:
            return (
                f"This model's maximum context length is {self.profile.max_model_len} tokens. However, you "
                f"requested {total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion)."
            )
        if total > self.profile.kv_capacity_tokens:
            return (
                f"The request needs {total} tokens of KV cache; this replica holds {self.profile.kv_capacity_tokens}."
            )
        return None

    # -- driving ----------------------------------------------------------------------------------

    def submit(self, request_id: str, *, prompt: str, prompt_tokens: int, max_tokens: int, now_s: float) -> None:
        """Queue a request; ValueError when it can never run (`refusal`) or its id is in use."""
        if max_tokens < 1 or prompt_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        why = self.refusal(prompt_tokens, max_tokens)
        if why is not None:
            raise ValueError(why)
        if request_id in self._running or any(seq.request_id == request_id for seq in self._waiting):
            raise ValueError(f"request {request_id!r} is already queued")
        self._waiting.append(_Sequence(request_id, prompt_tokens, max_tokens, now_s, prefix_block_keys(prompt)))

    def abort(self, request_id: str) -> bool:
        """Drop a request (its client went away); whether it was here. A planned step still completes."""
        if self._running.pop(request_id, None) is not None:
            return True
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                return True
        return False

    def plan(self, now_s: float) -> Step | None:
        """Admit what fits and return the next step starting at ``now_s``; None when idle."""
        if self._pending is not None:
            raise RuntimeError("complete the planned step before planning another")
        decode = tuple(self._running)
        admitted: list[_Sequence] = []
        reserved = sum(seq.reserved for seq in self._running.values())
        batched = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_num_seqs:
            seq = self._waiting[0]
            if admitted and batched + seq.prompt_tokens > self.max_num_batched_tokens:
                break
            if reserved + seq.reserved > self.profile.kv_capacity_tokens:
                break  # first come, first served: a later, smaller request does not jump the queue
            self._waiting.popleft()
            seq.admitted_s = now_s
            admitted.append(seq)
            reserved += seq.reserved
            batched += seq.prompt_tokens
        if not decode and not admitted:
            return None
        queries = sum(seq.prompt_tokens for seq in admitted)
        hits = sum(self._cache(seq) for seq in admitted)
        duration = 0.0
        if admitted:
            duration += self.profile.prefill_s(queries - hits)
        if decode:
            context = sum(self._running[r].held for r in decode) / len(decode)
            duration += self.profile.decode_step_s(len(decode), context)
        for seq in admitted:
            self._running[seq.request_id] = seq
        step = Step(
            start_s=now_s,
            duration_s=duration,
            prefill=tuple(seq.request_id for seq in admitted),
            decode=decode,
            prompt_tokens=queries,
            prefix_queries=queries,
            prefix_hits=hits,
        )
        self._pending = step
        return step

    def complete(self, step: Step) -> StepResult:
        """The end of ``step``: one token for each of its requests still here; finished ones leave."""
        if step is not self._pending:
            raise RuntimeError("complete the step `plan` returned last")
        self._pending = None
        now = step.end_s
        tokens: list[Token] = []
        ttfts: list[float] = []
        itls: list[float] = []
        finished: list[Finished] = []
        prompt_tokens = 0
        for request_id in (*step.prefill, *step.decode):
            seq = self._running.get(request_id)
            if seq is None:
                continue  # aborted during the step
            if seq.generated == 0:
                seq.first_token_s = now
                ttfts.append(now - seq.arrival_s)
                prompt_tokens += seq.prompt_tokens
            else:
                itls.append(now - seq.last_token_s)
            seq.last_token_s = now
            seq.generated += 1
            done = seq.generated >= seq.max_tokens
            tokens.append(Token(request_id, seq.generated - 1, done))
            if done:
                del self._running[request_id]
                finished.append(_finished(seq, now))
        return StepResult(
            tokens=tuple(tokens),
            prompt_tokens=prompt_tokens,
            generation_tokens=len(tokens),
            time_to_first_token_s=tuple(ttfts),
            inter_token_latency_s=tuple(itls),
            finished=tuple(finished),
        )

    def _cache(self, seq: _Sequence) -> int:
        """Tokens of ``seq``'s prompt found in the prefix cache (at most all but one); records its blocks."""
        hit_blocks = 0
        for key in seq.block_keys:
            if key not in self._prefix:
                break
            hit_blocks += 1
        for key in seq.block_keys:
            self._prefix[key] = None
            self._prefix.move_to_end(key)
        limit = max(1, self.profile.kv_capacity_tokens // BLOCK_TOKENS)
        while len(self._prefix) > limit:
            self._prefix.popitem(last=False)
        return min(hit_blocks * BLOCK_TOKENS, seq.prompt_tokens - 1)


def _finished(seq: _Sequence, now: float) -> Finished:
    decode = now - seq.first_token_s
    return Finished(
        request_id=seq.request_id,
        finish_reason=FINISH_LENGTH,
        prompt_tokens=seq.prompt_tokens,
        generation_tokens=seq.generated,
        max_tokens=seq.max_tokens,
        e2e_s=now - seq.arrival_s,
        queued_s=seq.admitted_s - seq.arrival_s,
        prefill_s=seq.first_token_s - seq.admitted_s,
        decode_s=decode,
        inference_s=now - seq.admitted_s,
        mean_time_per_output_token_s=decode / (seq.generated - 1) if seq.generated > 1 else 0.0,
    )


def reply_text(seed: int, tokens: Sequence[Token]) -> str:
    """The text of ``tokens`` of a reply whose prompt gave ``seed``."""
    return "".join(filler_token(seed, token.index) for token in tokens)
