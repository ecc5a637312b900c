"""Workloads that share prefixes: what does each call of a session or program send, and when?

It answers, for a tenant of a traffic file (``picker.sim.traffic``) with a shared system prompt,
chat sessions, RAG documents or agent programs, *what is call i of unit n, and how long after the
previous reply is it sent?* A *unit* is what one arrival starts: a session (``chat``), a program
(``agent``), or a single request (``system_prompt``, ``rag``). Everything is drawn from
(seed, tenant, unit, call), so the same seed gives the same prompts, lengths and pauses in the
load generator (``picker.sim.load``, which sends them over HTTP) and in the pool simulator
(``picker.sim.pool``, which plans a unit's next call when its previous one completes: closed loop
per unit, since the next prompt holds the previous reply).

The prompt of a call, as chat messages:

- ``system_prompt``: [system?, user question].
- ``chat``: [system?, user q1, assistant a1, ..., user q_t]: each turn resends the conversation.
- ``rag``: [system?, user "doc_a \\n\\n doc_b \\n\\n question"], ``per_request`` of the corpus's
  documents in the corpus's order, so requests whose first document is the same share it as a
  prefix.
- ``agent``: [system?, user task, assistant r1, user tool result 1, ..., user tool result_k]: each
  call is the context so far plus a tool result (sent as a user message, which every chat
  template accepts; a ``tool`` role needs a tool-call id that filler traffic does not have).

Texts are filler words of ``WORDS`` (each one token of ``picker.sim.tokenizer`` with its leading
space), so N words are about N tokens. A call's token ids are what the simulated server computes
for its messages (``picker.sim.openai_fmt.chat_prompt_ids``), so the pool simulator's engines hash
the same blocks as the server's. Replies are whatever the server answered (the load generator) or
the simulated server's text for that many tokens (the pool simulator).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from picker.sim import openai_fmt
from picker.sim.traffic import TenantTraffic

#: Filler vocabulary for prompts: short common words, each about one token for usual tokenizers.
WORDS: tuple[str, ...] = (
    "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "big", "red", "box", "in",
    "sun", "hot", "day", "we", "go", "up", "it", "is", "at", "by", "old", "new", "sea", "sky",
    "map", "pen", "cup", "hat",
)

Message = tuple[str, str]
"""(role, content)."""

_REPLY_HEADER = tuple(openai_fmt.chat_prompt_ids([{"role": "user", "content": ""}])[-3:])
"""The template's ids after the last message: the assistant's header the reply follows."""


def rng(seed: int, *parts: object) -> random.Random:
    """The random stream of (seed, parts): the same in every process and run."""
    return random.Random("/".join(str(p) for p in (seed, *parts)))


def words(stream: random.Random, count: int) -> str:
    """``count`` space-separated filler words drawn from ``stream``."""
    return " ".join(stream.choices(WORDS, k=count))


@functools.lru_cache(maxsize=256)
def system_prompt(seed: int, tenant: str, count: int) -> str:
    """The tenant's system prompt: the same text on every request of the tenant."""
    return words(rng(seed, tenant, "system"), count)


@functools.lru_cache(maxsize=256)
def document(seed: int, corpus: str, index: int, low: int, high: int) -> str:
    """Document ``index`` of ``corpus``: the same text for every tenant naming the corpus."""
    stream = rng(seed, "corpus", corpus, index)
    return words(stream, stream.randint(low, high))


@functools.lru_cache(maxsize=4096)
def message_ids(role: str, content: str) -> tuple[int, ...]:
    """The ids of one message as the simulated server's chat template renders it."""
    return tuple(openai_fmt.chat_prompt_ids([{"role": role, "content": content}])[:-3])


@dataclass(frozen=True)
class Call:
    """One call of a unit: its prompt as messages and as token ids, and what it asks for."""

    messages: tuple[Message, ...]
    token_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    call: int
    """Its index in the unit, from 0."""
    calls: int
    """Calls of the whole unit (turns of a session, K of a program)."""


class Unit:
    """One session, program or single request of a tenant, as it goes: ``call()`` is the call to
    send now, ``answered(reply)`` adds its reply and says how long after it the next call goes
    (None: the unit is over)."""

    def __init__(self, seed: int, tenant: TenantTraffic, seq: int) -> None:
        self.seed, self.tenant, self.seq = seed, tenant, seq
        self.session = f"{tenant.name}-{seq}"
        self.kind = tenant.workload
        unit = rng(seed, tenant.name, seq, "unit")
        if tenant.chat is not None:
            self.calls = unit.randint(*tenant.chat.turns)
        elif tenant.agent is not None:
            self.calls = tenant.agent.calls
        else:
            self.calls = 1
        self.index = 0
        self.messages: list[Message] = []
        self._ids: list[int] = []
        if tenant.system_prompt_tokens:
            self._add("system", system_prompt(seed, tenant.name, tenant.system_prompt_tokens))
        first = self._text(0, rng(seed, tenant.name, seq, 0).randint(*tenant.prompt_tokens))
        if tenant.rag is not None:
            rag = tenant.rag
            chosen = sorted(unit.sample(range(rag.documents), rag.per_request))
            docs = [document(seed, rag.corpus, i, *rag.document_tokens) for i in chosen]
            first = "\n\n".join([*docs, first])
        self._add("user", first)

    def _text(self, call: int, count: int) -> str:
        return words(rng(self.seed, self.tenant.name, self.seq, call, "words"), count)

    def _add(self, role: str, content: str) -> None:
        self.messages.append((role, content))
        self._ids.extend(message_ids(role, content))

    def call(self) -> Call:
        """The call to send now."""
        draw = rng(self.seed, self.tenant.name, self.seq, self.index)
        draw.randint(*self.tenant.prompt_tokens)  # the question's length, drawn where it is used
        output = draw.randint(*self.tenant.output_tokens)
        stream = draw.random() < self.tenant.stream_fraction
        return Call(tuple(self.messages), (*self._ids, *_REPLY_HEADER), output, stream,
                    self.index, self.calls)

    def answered(self, reply: str) -> float | None:
        """The current call's ``reply`` joins the context; returns the seconds before the next
        call (think time, tool latency), or None when this was the last call."""
        self.index += 1
        if self.index >= self.calls:
            return None
        self._add("assistant", reply)
        draw = rng(self.seed, self.tenant.name, self.seq, self.index)
        length = draw.randint(*self.tenant.prompt_tokens)
        draw.randint(*self.tenant.output_tokens)
        draw.random()
        if self.tenant.agent is not None:
            agent = self.tenant.agent
            delay = draw.uniform(*agent.tool_latency_s)
            self._add("user", self._text(self.index, draw.randint(*agent.tool_result_tokens)))
            return delay
        assert self.tenant.chat is not None  # only chat and agent units have a second call
        delay = draw.uniform(*self.tenant.chat.think_s)
        self._add("user", self._text(self.index, length))
        return delay


def chat_messages(messages: tuple[Message, ...]) -> list[dict[str, str]]:
    """``messages`` as a chat request body's ``messages``."""
    return [{"role": role, "content": content} for role, content in messages]
