"""Pipeline-parallel decoders (cells/pipeline.py; ORCA's inter-layer parallelism): the layers in
stages of about equal cost, a process each (gloo on the CPU), several iterations in flight on
disjoint sequences. Tokens must be those of one process and of HF transformers, under continuous
batching, for conversations, with cancels; a stage that dies fails the requests; stopping leaves
no process. Log-probabilities come back with the tokens as one more message, bit for bit (their
values against one process's: tests/test_logprobs.py)."""
import multiprocessing
import random
from dataclasses import replace

import pytest
import torch

from batchmaker import Engine
from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.cells.pipeline import PendingTokens, StageCut, check_stages, pack_scores, stage_bounds, unpack_scores
from batchmaker.registry import build_model
from test_generation import assert_sent_at_once_equal_hf, hf_greedy, step
from test_tensor_parallel_engine import TINY_HF, converse_and_cancel, kill_a_rank, save_tiny, serve, workload

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("preset, stages", [("llama-2-7b", 2), ("llama-2-7b", 4), ("llama-2-70b", 8), ("tiny-llama", 2)])
def test_stages_cover_the_layers_at_about_equal_cost(preset, stages):
    config = PRESETS[preset]
    bounds = stage_bounds(config, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == config.num_layers
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 2  # (the last stage, with the head, a layer or two lighter)
    assert sizes[-1] <= sizes[0]


def test_stages_the_layers_cannot_fill_are_refused():
    with pytest.raises(ValueError, match="more stages than the model's 2 layers"):
        check_stages(PRESETS["tiny-llama"], 3)
    with pytest.raises(ValueError, match="pipeline_parallel"):
        build_model("llama", pipeline_parallel=0)


@pytest.mark.parametrize("tied", [False, True])
def test_each_stage_builds_its_layers_of_the_same_random_model(tied):
    config = replace(PRESETS["tiny-opt"] if tied else PRESETS["tiny-llama"], num_layers=4)
    whole = build_decoder(config, seed=5).state_dict()
    held = set()
    for stage in range(3):
        cut = StageCut.of(config, stage, 3)
        part = build_decoder(config, seed=5, cut=cut).state_dict()
        for name, t in whole.items():
            local = cut.take(name)
            if local is not None:
                assert torch.equal(part[local], t), (stage, name)
                held.add(name)
        empty = [n for n, t in part.items() if t.numel() == 0]
        assert all(n.split(".")[0] in ("embed_tokens", "embed_positions", "norm", "lm_head") for n in empty)
    assert held == set(whole)  # (every parameter on some stage)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_two_stages_give_the_tokens_of_one(family):
    requests = workload(random.Random(11), family, n=12)
    one = serve(build_model(family, seed=2, max_tokens=48), requests, seed=4)
    two = serve(build_model(family, seed=2, max_tokens=48, pipeline_parallel=2), requests, seed=4)
    assert two == one and len(one) == len(requests)
    assert not multiprocessing.active_children()


def test_three_stages_follow_hf(tmp_path):
    """A checkpoint of 4 layers with one kv head, in three stages: HF's greedy tokens."""
    from batchmaker.cells.decoder_config import to_hf
    config = dict(to_hf(PRESETS["tiny-llama"]), num_hidden_layers=4, num_key_value_heads=1)
    torch.manual_seed(8)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    hf.save_pretrained(tmp_path)
    requests = [r for r in workload(random.Random(12), "llama", n=8) if "temperature" not in r[1]]
    got = serve(build_model("llama", checkpoint=str(tmp_path), max_tokens=48, pipeline_parallel=3), requests, seed=5)
    for tokens, (_, inputs) in zip(got, requests):
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])


@pytest.mark.parametrize("name", list(TINY_HF))
def test_two_stages_follow_hf_for_requests_sent_at_once(name, tmp_path):
    hf = save_tiny(name, tmp_path)
    assert_sent_at_once_equal_hf(hf, tmp_path, family=TINY_HF[name][0], pipeline_parallel=2)
    assert not multiprocessing.active_children()


def test_a_conversation_and_a_cancel_in_two_stages():
    def run(stages: int) -> tuple:
        engine = Engine([build_model("llama", seed=3, max_tokens=48, pipeline_parallel=stages)]).start(thread=False)
        try:
            return converse_and_cancel(engine)
        finally:
            engine.stop()
    assert run(2) == run(1)


def test_iterations_in_flight_hold_disjoint_sequences():
    """ORCA's pipeline: with two stages, two iterations run at once, and none holds a sequence
    whose last token is still in the other (the plan carries each decode's token: stage 0 feeds
    it); sequences that start together spread over both (an iteration decodes half of them)."""
    engine = Engine([build_model("llama", seed=1, max_tokens=48, pipeline_parallel=2)]).start(thread=False)
    try:
        worker = engine.workers[0]
        seen, overlap, most, decodes = [], [], 0, []
        submit = worker.submit

        def spy(task):
            live = [t for t in seen if t.sampled is None and t.error is None]
            if task.kind == "iteration":
                assert (task.plan.tokens >= 0).all()
                overlap.extend(set(task.slots.tolist()) & set(s for t in live for s in t.slots[t.sample].tolist()))
                seen.append(task)
                if task.plan.decode_only:
                    decodes.append(len(task.slots))
            submit(task)
        worker.submit = spy
        futures = [engine.submit("llama", {"tokens": [i + 2] * (3 + i), "max_new_tokens": 12, "ignore_eos": True})
                   for i in range(8)]
        while not all(f.done() for f in futures):
            step(engine)
            most = max(most, worker.num_in_flight)
        assert all(f.result(0).outputs["tokens"] for f in futures)
        assert most == 2 and not overlap
        assert max(decodes) <= 4 and decodes.count(4) > 4, decodes
    finally:
        engine.stop()


def test_a_stage_that_dies_fails_the_requests_and_nothing_is_left_behind():
    engine = Engine([build_model("llama", seed=1, max_tokens=48, pipeline_parallel=2)]).start()
    try:
        kill_a_rank(engine)
    finally:
        engine.stop()
    assert not multiprocessing.active_children()


class FakeStage:
    """A stage's sends and receives, recorded (exec/stage_exchange.py's contract)."""

    def __init__(self, stage: int, stages: int, shard: int = 0):
        self.first, self.last, self.calls = stage == 0, stage == stages - 1, []
        self.receives_tokens, self.sends_tokens = self.first and shard == 0, self.last and shard == 0

    def receive(self, into):
        self.calls.append(("receive", into))

    def send(self, stream):
        self.calls.append(("send", stream))

    def send_tokens(self, chosen, scores=None):
        self.calls.append(("send_tokens", chosen) if scores is None else ("send_tokens", chosen, scores))

    def receive_tokens(self, count, device, logprobs=-1):
        self.calls.append(("receive_tokens", count) if logprobs < 0 else ("receive_tokens", count, logprobs))
        return PendingTokens((), torch.zeros(count, dtype=torch.int64))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_stage_receives_before_and_sends_after_its_work_and_graphs_keep_one_buffer(stage):
    from batchmaker.exec.stage_exchange import StageExchange
    fake = FakeStage(stage, 3)
    exchange = StageExchange(fake, 8, torch.float32, torch.device("cpu"))
    seen = []

    def forward(inbox):
        seen.append(inbox)
        fake.calls.append(("forward", None))
        return torch.ones(2, 5, 8) if not fake.last else torch.tensor([7, 7, 7])

    outs = [exchange.around(forward, 5, 3, graphed=True), exchange.around(forward, 5, 3, graphed=True),
            exchange.around(forward, 5, 3)]
    kinds = [kind for kind, _ in fake.calls]
    expected = {0: ["forward", "send", "receive_tokens"], 1: ["receive", "forward", "send"],
                2: ["receive", "forward", "send_tokens"]}[stage]
    assert kinds == expected * 3
    if stage == 0:
        assert seen == [None] * 3 and all(out.tolist() == [0, 0, 0] for out in outs)
    else:
        assert seen[0] is seen[1] and seen[2] is not seen[0] and seen[0].shape == (2, 5, 8)  # (a graph's buffer, kept)
        assert outs == [None] * 3 if stage == 1 else all(out.tolist() == [7, 7, 7] for out in outs)


@pytest.mark.parametrize("k", [0, 3])
def test_the_scores_go_back_as_one_message_bit_for_bit(k):
    from batchmaker.exec.sampling import log_probabilities
    logits = torch.randn(4, 50) * 10
    logits[1, :] = float("-inf")
    logits[1, 7] = 0.0  # (a row whose other tokens have no probability: -inf kept)
    scores = log_probabilities(logits, torch.tensor([3, 7, 0, 49]), k)
    packed = pack_scores(*scores)
    assert packed.dtype == torch.int32 and packed.shape == (4, 1 + 2 * k)
    for sent, got in zip(scores, unpack_scores(packed)):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


@pytest.mark.parametrize("stage", [0, 1])
def test_the_last_stage_sends_the_scores_the_plan_asks_for_and_stage_0_expects_them(stage):
    from batchmaker.exec.stage_exchange import StageExchange
    fake = FakeStage(stage, 2)
    exchange = StageExchange(fake, 8, torch.float32, torch.device("cpu"))
    scores = (torch.zeros(3), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2))
    out = exchange.around(lambda inbox: torch.ones(2, 5, 8) if stage == 0 else (torch.tensor([7, 7, 7]), scores),
                          5, 3, tokens_back=lambda count, logprobs: fake.receive_tokens(count, None, logprobs),
                          logprobs=2)
    if stage == 0:
        assert fake.calls[-1] == ("receive_tokens", 3, 2) and isinstance(out, PendingTokens)
    else:
        assert fake.calls[-1][0] == "send_tokens" and fake.calls[-1][2] is scores and out[1] is scores
