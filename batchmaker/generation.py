"""Models served by a `Generate` form (batchmaker/forms.py): decoder Transformers. Admission of
generation requests, and what happens to their futures as iterations sample tokens.

A request's inputs:
  tokens           list[int]: the prompt's token ids (non-empty), or
  prompt           str: the prompt as text (models with a tokenizer)
  max_new_tokens   int >= 0 (default: the form's); generation also stops at the model's length
  temperature      float >= 0 (default 0: greedy); top_k int >= 0 (0: all); top_p in (0, 1]
  seed             int: sampling is a pure function of (seed, position), so a seeded request
                   gives the same tokens however it is batched
  stop_token_ids   list[int] (at most 7), besides the model's EOS; ignore_eos bool
  logprobs         int in [0, 20]: each generated token's log-probability, and those of the k
                   most likely tokens, under the model's distribution (before temperature, top-k
                   and top-p)
  conversation     true: start a conversation with this turn; "<id>": its next turn, whose
                   prompt follows everything said so far (the cache keeps it; core/conversations.py)
Reply: {"tokens": [generated ids], "finish_reason": "stop" | "length"} (+ "text" for a text
prompt; + "conversation": id and "context": where the previous turns' positions came from; +
"logprobs": [per token], "top_logprobs": [per token: [[id, logprob], ...]] when asked).
Streamed partials carry each iteration's new token ({"tokens": [id]}, + "text", + its logprobs).
{"conversation": id, "end": true} ends a conversation ({"conversation": id, "ended": true}).
"""
import itertools
import math
import random
import time
import weakref

import numpy as np

from batchmaker.core.admission import check_context, check_keys, check_tokens, is_int
from batchmaker.core.blocks import BlockTables, check_fits
from batchmaker.core.conversation_cache import ConversationCache
from batchmaker.core.conversations import Conversation, Conversations
from batchmaker.core.decoder_facts import DecoderFacts
from batchmaker.core.sequence_queue import SequenceQueue
from batchmaker.core.sequences import MAX_STOPS, Sequences
from batchmaker.core.waiting import Chunk
from batchmaker.errors import BadRequestError
from batchmaker.core.request import Result
from batchmaker.detokenize import IncrementalDetokenizer
from batchmaker.structured import Finisher

OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "conversation",
           "logprobs")
MAX_LOGPROBS = 20  # the most likely tokens a request may ask the log-probabilities of (OpenAI's bound)


class GenerativeModel(Finisher):
    def __init__(self, model, cell_types: dict, accounting):
        super().__init__(model, accounting)
        self.form = model.forms[0]
        self.cell_type = cell_types[self.form.cell]
        self.cell = self.cell_type.cell
        if self.cell.batch_unit != "tokens":
            raise TypeError(f"model {model.name!r}: a Generate form needs a DecoderCell, got {type(self.cell).__name__}")
        config = self.cell.config  # (the whole model's: rank 0 holds a shard of a tensor-parallel one)
        self.vocab, self.max_len = config.vocab_size, config.max_positions
        self.eos = tuple(config.eos_token_ids)
        self.tokenizer = getattr(self.cell, "tokenizer", None)
        self.queue: SequenceQueue | None = None
        self.queues: list = []
        self.num_blocks = 0  # of the smallest worker
        # text prompts: the future -> the text streamed so far (gone with the future, cancelled or not)
        self._texts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._logprobs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> (logprobs, top) lists
        self._seeds = itertools.count(random.getrandbits(40))
        self.turns = Conversations({}, self.form.conversation_ttl)  # conversations across turns (set by `build`)

    @property
    def conversations(self) -> dict[str, Conversation]:
        return self.turns.by_id

    @property
    def caches(self) -> dict[int, ConversationCache]:
        return self.turns.caches

    def facts_from(self, worker) -> DecoderFacts | None:
        """What this model's queue needs of a started worker: its decoder's facts (None: the
        worker does not serve it, as only worker 0 serves a tensor-parallel decoder)."""
        return worker.decoder_facts.get(id(self.cell_type))

    def build(self, facts: dict[int, DecoderFacts | None]) -> list:
        """The model's queue, given what each worker serving it measured at start-up."""
        facts = {worker: f for worker, f in facts.items() if f is not None}
        sequences = {}
        for worker, f in facts.items():
            blocks = BlockTables(f.num_blocks, self.cell.block_size, self.cell.max_seqs, self.max_len,
                                 self.cell.kv.prefix_caching)
            sequences[worker] = Sequences(self.cell.max_seqs, self.max_len, blocks)
        self.num_blocks = min(q.blocks.num_blocks for q in sequences.values())
        kv = self.cell.kv
        caches = {worker: ConversationCache(sequences[worker].blocks, f.host_chunks, f.chunk_tokens, f.chunk_costs,
                                            kv.eviction, kv.swap_threshold, f.max_swap_out, f.max_swap_in,
                                            kv.swap_out_rows, swap_in_seconds=f.swap_in_seconds)
                  for worker, f in facts.items()}
        self.turns = Conversations(caches, self.form.conversation_ttl,
                                   {worker: f.chunk_bytes for worker, f in facts.items()})
        self.queue = SequenceQueue(self.cell_type, sequences, self, kv.reserve, self.turns,
                                   {worker: f.shapes for worker, f in facts.items()},
                                   stages=self.cell.pipeline_parallel)
        self.queues = [self.queue]
        return self.queues

    def warm_list(self) -> list:
        return [("iteration", self.cell_type)]

    # admission ------------------------------------------------------------------------------------
    def admit(self, futures: list) -> None:
        good, rows, prompts = [], [], []
        self.turns.sweep()
        for f in futures:
            try:
                if isinstance(f.inputs, dict) and "end" in f.inputs:
                    self._end(f)
                    continue
                prompt, row = self._check(f)
            except BadRequestError as e:
                self.fail([f], e)
                continue
            conversation = row["conversation"]
            if row["logprobs"] >= 0:  # (its reply has the lists, empty if it samples nothing)
                self._logprobs[f] = ([], [])
            if row["max_new"] == 0:  # nothing to compute now; a conversation keeps the prompt for its next turn
                if conversation is not None:
                    self.turns.add_prompt(conversation, prompt)
                self._resolve(f, [], "length", f.arrival, conversation)
                continue
            if conversation is not None:
                self.turns.begin(conversation, f)
            good.append(f)
            rows.append(row)
            prompts.append(prompt)
        if not good:
            return
        owners = np.empty(len(good), dtype=object)
        owners[:] = good
        columns = {name: np.array([r[name] for r in rows]) for name in rows[0] if name != "conversation"}
        columns["conversation"] = np.empty(len(rows), dtype=object)
        columns["conversation"][:] = [r["conversation"] for r in rows]
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        chunk = Chunk.of(owners, columns, np.concatenate(prompts), lengths)
        self.queue.add(columns["priority"], chunk)

    def _check(self, f) -> tuple[np.ndarray, dict]:
        inputs = f.inputs
        key = prompt_key(inputs)
        check_keys(inputs, [key], OPTIONS)
        prompt = check_prompt(inputs, key, self.tokenizer, self.vocab, self.name)
        if key == "prompt":
            self._texts[f] = IncrementalDetokenizer(self.tokenizer)
        conversation = self.turns.of_request(inputs.get("conversation"))
        history = len(conversation.tokens) if conversation is not None else 0
        check_context(len(prompt), history, self.max_len, key)
        max_new = check_max_new(inputs, self.form.max_new_tokens)
        if conversation is None and self.cell.kv.prefix_caching and max_new > 0 and "conversation" not in inputs:
            conversation = self.turns.match(prompt)  # (a stateless request continuing a cached context)
            if conversation is None:
                conversation = self.turns.anonymous()
            prompt, history = prompt[len(conversation.tokens):], len(conversation.tokens)
        check_fits(min(history + len(prompt) + max_new, self.max_len), self.cell.block_size, self.num_blocks)
        sampling = self._sampling(inputs)
        stops = check_stops(inputs, self.eos, self.vocab)
        row = {"prompt_len": len(prompt), "max_new": int(max_new), **sampling,
               "stops": stops + [-1] * (MAX_STOPS - len(stops)), "priority": f.priority, "first": math.nan,
               "joined": math.nan, "streams": f.on_partial is not None, "history": history,
               "conversation": conversation}
        return prompt, row

    def _sampling(self, inputs: dict) -> dict:
        """A request's sampling settings, checked: temperature, top_p, top_k, seed (drawn when not
        given) and logprobs (-1: none)."""
        temperature = _number(inputs.get("temperature", 0.0), "temperature", 0.0, math.inf)
        top_p = _number(inputs.get("top_p", 1.0), "top_p", 0.0, 1.0)
        if top_p == 0.0:
            raise BadRequestError("top_p: expected a number in (0, 1]")
        top_k = inputs.get("top_k", 0)
        if not is_int(top_k) or top_k < 0:
            raise BadRequestError(f"top_k: expected an integer >= 0, got {top_k!r}")
        logprobs = inputs.get("logprobs", -1)
        if logprobs != -1 and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise BadRequestError(f"logprobs: expected an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
        seed = inputs.get("seed")
        if seed is None:
            seed = next(self._seeds)
        elif not is_int(seed) or not -(2**63) <= seed < 2**63:
            raise BadRequestError(f"seed: expected a 64-bit integer, got {seed!r}")
        return {"temperature": temperature, "top_k": int(top_k), "top_p": top_p, "seed": int(seed),
                "logprobs": int(logprobs)}

    # conversations --------------------------------------------------------------------------------
    def _end(self, f) -> None:
        try:
            check_keys(f.inputs, ["conversation", "end"])
            if f.inputs["end"] is not True:
                raise BadRequestError(f"end: expected true, got {f.inputs['end']!r}")
            conversation = self.turns.of_request(f.inputs["conversation"])
            if conversation is None or conversation.id not in self.turns.by_id:
                raise BadRequestError("end: name the conversation to end by its id")
        except BadRequestError as e:
            self.fail([f], e)
            return
        self.turns.end(conversation)
        now = time.perf_counter()
        self.accounting.finished(f, now - f.arrival)
        f.set_result(Result({"conversation": conversation.id, "ended": True, "turns": conversation.turns}, None,
                            (f.arrival, now, now)))

    def conversation_stats(self) -> dict:
        return self.turns.stats()

    # the queue's finisher side (manager thread) -------------------------------------------------
    def tokens(self, q: Sequences, slots: np.ndarray, tokens: np.ndarray, done: np.ndarray,
               stopped: np.ndarray, logprobs: tuple | None = None) -> None:
        """An iteration sampled `tokens` for `slots` (their serials current), with their
        log-probabilities where its plan asked for them: stream them, and resolve the requests
        that are `done`."""
        now = time.perf_counter()
        first = np.isnan(q.first[slots])
        q.first[slots[first]] = now
        owners = q.owner[slots]
        scored = self._score(q, slots, owners, logprobs) if logprobs is not None else {}
        for i in np.flatnonzero(q.streams[slots]).tolist():
            partial = {"tokens": [int(tokens[i])]}
            text = self._text_delta(owners[i], int(tokens[i]))
            if text is not None:
                partial["text"] = text
            if i in scored:
                partial["logprobs"], partial["top_logprobs"] = [scored[i][0]], [scored[i][1]]
            self.stream(owners[i], partial)
        for i in np.flatnonzero(done).tolist():
            s = int(slots[i])
            generated = q.tokens[s, q.prompt_len[s]:q.length[s]].tolist()
            self._resolve(owners[i], generated, "stop" if stopped[i] else "length", float(q.joined[s]),
                          q.conversation[s], float(q.first[s]))

    def _score(self, q: Sequences, slots: np.ndarray, owners: np.ndarray, logprobs: tuple) -> dict:
        """Each asking sequence's (logprob, [[id, logprob] of its top k]) of this token, kept for its reply."""
        chosen, top_ids, top_values = logprobs
        scored = {}
        for i in np.flatnonzero(q.logprobs[slots] >= 0).tolist():
            k = int(q.logprobs[slots[i]])
            entry = (float(chosen[i]), [[int(t), float(v)] for t, v in zip(top_ids[i, :k], top_values[i, :k])])
            kept = self._logprobs[owners[i]]
            kept[0].append(entry[0])
            kept[1].append(entry[1])
            scored[i] = entry
        return scored

    def _text_delta(self, owner, token: int) -> str | None:
        """The text `token` adds to `owner`'s streamed text: whole characters only (a token that
        ends inside one adds "" until the next completes it; the final reply has all the text)."""
        text = self._texts.get(owner)
        return None if text is None else text.add(token)

    def _resolve(self, owner, generated: list, reason: str, first: float, conversation=None,
                 first_token: float | None = None) -> None:
        """Resolve `owner`'s future; `first`: its first cell's instant (when it joined a slot), so
        the timing splits waiting for a slot and blocks (queueing) from prefill + decode;
        `first_token`: when its first token was sampled (time to first token)."""
        if owner._done:
            return
        outputs = {"tokens": generated, "finish_reason": reason}
        if conversation is not None:
            gpu, swapped, recomputed = conversation.restored
            if not conversation.anonymous:
                outputs["conversation"] = conversation.id
            outputs["context"] = {"cached": gpu, "swapped_in": swapped, "recomputed": recomputed}
            if conversation.shared:  # (prefix caching: leading positions other requests computed)
                outputs["context"]["shared"] = conversation.shared
        if self._texts.pop(owner, None) is not None:
            outputs["text"] = self.tokenizer.decode(generated)
        scored = self._logprobs.pop(owner, None)
        if scored is not None:
            outputs["logprobs"], outputs["top_logprobs"] = scored
        now = time.perf_counter()
        self.accounting.finished(owner, now - owner.arrival)
        owner.set_result(Result(outputs, None, (owner.arrival, first, now, first_token)))


# a request's prompt and limits, checked (also for a decoder served offloaded: offloaded.py) -----------
def prompt_key(inputs) -> str:
    return "prompt" if isinstance(inputs, dict) and "prompt" in inputs else "tokens"


def check_prompt(inputs: dict, key: str, tokenizer, vocab: int, name: str) -> np.ndarray:
    """The prompt's token ids: `tokens` checked against the vocabulary, or `prompt` text encoded."""
    if key == "prompt":
        if tokenizer is None:
            raise BadRequestError(f"model {name!r} has no tokenizer: send token ids as 'tokens'")
        if not isinstance(inputs["prompt"], str):
            raise BadRequestError(f"prompt: expected a string, got {type(inputs['prompt']).__name__}")
        ids = tokenizer.encode(inputs["prompt"]).ids
        if not ids:
            raise BadRequestError("prompt: the text gives no tokens")
        return np.asarray(ids, dtype=np.int64)
    if isinstance(inputs["tokens"], (list, tuple)) and not inputs["tokens"]:
        raise BadRequestError("tokens: the prompt is empty")
    return check_tokens(inputs["tokens"], vocab, "tokens")


def check_max_new(inputs: dict, default: int) -> int:
    max_new = inputs.get("max_new_tokens", default)
    if not is_int(max_new) or max_new < 0:
        raise BadRequestError(f"max_new_tokens: expected an integer >= 0, got {max_new!r}")
    return int(max_new)


def check_stops(inputs: dict, eos: tuple, vocab: int) -> list[int]:
    """The ids that end the request: the model's EOS (unless ignore_eos) and its stop_token_ids."""
    ignore_eos = inputs.get("ignore_eos", False)
    if type(ignore_eos) is not bool:
        raise BadRequestError(f"ignore_eos: expected true or false, got {ignore_eos!r}")
    stops = list(() if ignore_eos else eos)
    extra = inputs.get("stop_token_ids", [])
    if extra:
        stops += check_tokens(extra, vocab, "stop_token_ids").tolist()
    if len(stops) > MAX_STOPS:
        raise BadRequestError(f"stop_token_ids: at most {MAX_STOPS - len(eos)} besides EOS")
    return stops


def _number(value, what: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise BadRequestError(f"{what}: expected a number in [{low}, {high}], got {value!r}")
    return float(value)
