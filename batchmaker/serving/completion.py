"""One HTTP generation request in the engine: each of its choices is one engine request. Tokens
arrive on the manager thread (streamed partials, or the result), cross to the HTTP loop through
the LoopBridge (a turn's partials in one wake-up of the loop), and become text there:
detokenized, cut at stop strings. Events (text of one choice, its finish reason on its last
event, or an error) are handed over once per drain: to a handler awaiting `next_events()`, or,
once a stream's headers are out, straight to its writer (`deliver_to`), with no task woken.

A choice that meets a stop string is cancelled in the engine at once (its KV cache is freed);
`cancel()` cancels every unfinished choice (a client that went away, a failed sibling).
"""
import asyncio
import itertools
import time
from dataclasses import dataclass

from batchmaker.detokenize import IncrementalDetokenizer, StopMatcher
from batchmaker.serving.loop_bridge import LoopBridge
from batchmaker.serving.openai_api import ApiError, GenerationRequest, engine_error


@dataclass(slots=True)
class Event:
    index: int  # the choice
    text: str
    finish_reason: str | None = None  # on the choice's last event: "stop" or "length"
    error: ApiError | None = None  # the choice failed (its last event)
    scores: list | None = None  # asked log-probabilities: (token id, logprob, [[id, logprob], ...]) of its tokens


class Choice:
    """One choice's text as its tokens come: stop tokens leave no text, stop strings end it."""

    __slots__ = ("index", "detokenizer", "matcher", "stop_ids", "future", "num_tokens", "finish_reason", "last_token",
                 "scores")

    def __init__(self, index: int, request: GenerationRequest):
        self.index = index
        self.detokenizer = IncrementalDetokenizer(request.model.tokenizer)
        self.matcher = StopMatcher(request.stops) if request.stops else None
        self.stop_ids = request.stop_ids
        self.future = None  # the engine's RequestFuture
        self.num_tokens = 0
        self.finish_reason: str | None = None  # set once: stop, length, error, cancelled
        self.last_token = 0.0  # perf_counter instant of its latest token (0: none yet)
        self.scores = [] if request.logprobs >= 0 else None  # of tokens not yet in an event

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, score: tuple | None = None) -> str:
        """The text `token` adds; a stop string ending in it sets finish_reason "stop". `score`:
        its (logprob, top alternatives), kept for the next event when asked."""
        self.num_tokens += 1
        if token in self.stop_ids:  # EOS or a stop id: the engine's last token, not part of the text
            return ""
        if self.scores is not None and score is not None:
            self.scores.append((token, *score))
        return self._cut(self.detokenizer.add(token))

    def take_scores(self) -> list | None:
        scores, self.scores = self.scores, ([] if self.scores is not None else None)
        return scores

    def finish(self, reason: str) -> str:
        """The engine finished the choice: the text still held."""
        text = self._cut(self.detokenizer.flush())
        if self.matcher is not None and not self.matcher.is_stopped:
            text += self.matcher.flush()
        if self.finish_reason is None:
            self.finish_reason = reason
        return text

    def _cut(self, text: str) -> str:
        if self.matcher is None or not text:
            return text
        text = self.matcher.add(text)
        if self.matcher.is_stopped:
            self.finish_reason = "stop"
        return text


class Completion:
    def __init__(self, engine, bridge: LoopBridge, request: GenerationRequest, metrics):
        self.engine, self.request, self.metrics = engine, request, metrics
        self._events: list[Event] = []  # not yet handed over
        self._waiter: asyncio.Future | None = None  # set when events arrive for a waiting handler
        self._sink = None  # deliver_to's callable, else events wait for next_events()
        self._is_handing = False  # a hand-over is due at the end of the running drain
        self.choices = [Choice(i, request) for i in range(request.num_choices)]
        self.arrival = time.perf_counter()
        self._bridge = bridge
        self._streams = request.stream or bool(request.stops)  # tokens as they come (not only the result)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.request.prompts))

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def start(self) -> None:
        """Submit every choice; ApiError if the engine refuses one at once (overloaded, stopping)."""
        name, call, post = self.request.model.name, self._bridge.call, self._bridge.post
        for choice in self.choices:
            on_partial = (lambda partial, c=choice: post(self._on_tokens, c, partial)) if self._streams else None
            choice.future = self.engine.submit(name, self.request.engine_inputs(choice.index), on_partial=on_partial)
            if choice.future.done() and choice.future.exception() is not None:
                choice.finish_reason = "error"
                self.cancel()
                raise engine_error(choice.future.exception())
            choice.future.add_done_callback(lambda f, c=choice: call(self._on_done, c, f))

    def cancel(self) -> None:
        """Cancel every unfinished choice in the engine (each frees its sequence at its next turn)."""
        for choice in self.choices:
            if not choice.is_done:
                choice.finish_reason = "cancelled"
                if choice.future is not None:
                    self.engine.cancel(choice.future.request_id)
                self.metrics.finished(self.request.model.name, "cancelled", choice.num_tokens)

    def deliver_to(self, sink) -> None:
        """From now on, sink(events) on the loop thread, once per drain that brought some (and now,
        with those waiting), instead of next_events(); None: held for next_events() again."""
        self._sink = sink
        if sink is not None and self._events:
            events, self._events = self._events, []
            sink(events)

    async def next_events(self) -> list[Event]:
        """The events since the last call, in order; waits for one if there is none (one wake-up
        for however many came meanwhile)."""
        if not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        events, self._events = self._events, []
        return events

    # on the loop thread, through the bridge ------------------------------------------------------
    def _put(self, event: Event) -> None:
        self._events.append(event)
        if not self._is_handing:
            self._is_handing = True
            self._bridge.after_drain(self._hand_over)

    def _hand_over(self) -> None:
        self._is_handing = False
        if self._sink is not None:
            events, self._events = self._events, []
            self._sink(events)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_tokens(self, choice: Choice, partial: dict) -> None:
        if choice.is_done:
            return
        self._timed(choice)
        text = ""
        for token, score in zip(partial["tokens"], _scores(partial)):
            text += choice.add(token, score)
            if choice.is_done:
                break
        if choice.is_done:  # a stop string: the rest is not wanted
            self.engine.cancel(choice.future.request_id)
            self._finished(choice, text)
        elif text:
            self._put(Event(choice.index, text, scores=choice.take_scores()))

    def _on_done(self, choice: Choice, future) -> None:
        if choice.is_done:  # stopped by a stop string, or cancelled
            return
        error = future.exception()
        if error is not None:
            choice.finish_reason = "error"
            self.metrics.finished(self.request.model.name, "error", choice.num_tokens)
            self._put(Event(choice.index, "", error=engine_error(error)))
            return
        result = future.result()
        outputs = result.outputs
        text = ""
        if not self._streams:  # (its tokens come all at once: timed by the engine's instants)
            text = "".join(choice.add(t, score) for t, score in zip(outputs["tokens"], _scores(outputs)))
            self._timed_whole(result.timing, len(outputs["tokens"]))
        self._finished(choice, text + choice.finish(outputs["finish_reason"]))

    def _finished(self, choice: Choice, text: str) -> None:
        self.metrics.finished(self.request.model.name, choice.finish_reason, choice.num_tokens)
        self._put(Event(choice.index, text, choice.finish_reason, scores=choice.take_scores()))

    def _timed(self, choice: Choice) -> None:
        now = time.perf_counter()
        if choice.last_token:
            self.metrics.inter_token(self.request.model.name, now - choice.last_token)
        else:
            self.metrics.first_token(self.request.model.name, now - self.arrival)
        choice.last_token = now

    def _timed_whole(self, timing, num_tokens: int) -> None:
        """A choice that did not stream: its first token when the engine sampled it, and for each
        later token the mean gap (the engine keeps no instant per token)."""
        if timing.first_token is None:
            return
        name = self.request.model.name
        self.metrics.first_token(name, timing.first_token - self.arrival)
        if num_tokens > 1:
            self.metrics.inter_token(name, (timing.finish - timing.first_token) / (num_tokens - 1), num_tokens - 1)


def _scores(outputs: dict):
    """(logprob, top alternatives) of each token of a partial or a result; None each when not asked."""
    if "logprobs" not in outputs:
        return itertools.repeat(None)
    return zip(outputs["logprobs"], outputs["top_logprobs"])
