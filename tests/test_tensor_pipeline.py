"""Tensor and pipeline parallelism together (cells/stage_shards.py): two stages of two
tensor-parallel shards, four processes (gloo on the CPU), rank = stage * 2 + shard. Tokens must be
those of one process and of HF transformers for a Llama with fewer kv heads than shards, under
continuous batching with mixed prompt lengths, for a conversation, with a cancel mid-stream and
with seeded sampling, log-probabilities included; a rank that dies fails the requests; stopping leaves no process."""
import json
import multiprocessing
import random
from dataclasses import replace

import pytest
import torch

from batchmaker import Engine
from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_cell import DecoderCell
from batchmaker.cells.decoder_config import PRESETS, to_hf
from batchmaker.cells.decoder_source import DecoderSource
from batchmaker.cells.pipeline import StageCut
from batchmaker.cells.stage_shards import StageShardCut
from batchmaker.cells.tensor_parallel import slicing
from batchmaker.registry import build_model
from test_generation import drive, hf_greedy
from test_logprobs import assert_same_logprobs
from test_pipeline_parallel import FakeStage
from test_tensor_parallel_engine import converse_and_cancel, kill_a_rank, workload

transformers = pytest.importorskip("transformers")

GRID = dict(tensor_parallel=2, pipeline_parallel=2)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """A HF Llama of 4 query heads over 1 kv head (replicated on both shards of a stage), saved."""
    config = dict(to_hf(PRESETS["tiny-llama"]), num_key_value_heads=1)
    torch.manual_seed(21)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    path = tmp_path_factory.mktemp("tp-pp")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.mark.parametrize("tied", [False, True])
def test_each_rank_holds_its_shard_of_its_stages_layers(tied):
    config = replace(PRESETS["tiny-llama"], num_kv_heads=1, num_layers=3, tie_word_embeddings=tied)
    whole = build_decoder(config, seed=5).state_dict()
    cell = DecoderCell(None, source=DecoderSource(config), **GRID)
    for rank in range(4):
        cut = cell.cut(rank)
        stage = StageCut.of(config, rank // 2, 2)
        assert cut == StageShardCut(stage, cut.shard) and cut.shard.rank == rank % 2
        part = build_decoder(config, seed=5, cut=cut)
        state = part.state_dict()
        for name, t in whole.items():
            local = stage.take(name)
            if local is not None:
                assert torch.equal(state[local], slicing(name, config, rank % 2, 2).cut(t)), (rank, name)
        c = part.config
        assert (c.num_layers, c.num_heads, c.num_kv_heads) == (stage.end - stage.first, 2, 1)
        assert state["embed_tokens.weight"].shape[0] == (256 if stage.stage == 0 or tied else 0)
        assert state["norm.weight"].numel() == (64 if stage.last else 0)


def serve_and_talk(model, requests: list) -> tuple:
    """The requests' outputs (random arrivals), then a conversation and a cancel mid-stream."""
    engine = Engine([model]).start(thread=False)
    try:
        outputs = [f.result(0).outputs for f in drive(engine, requests, random.Random(9))]
        talk = converse_and_cancel(engine)
        queue = engine.structured["llama"].queue
        assert all(q.num_active == 0 for q in queue.sequences.values())  # (the cancelled one's slot freed)
        return outputs, talk
    finally:
        engine.stop()


def test_two_stages_of_two_shards_give_the_tokens_of_one_process_and_of_hf(one_kv_head):
    path, hf = one_kv_head
    requests = workload(random.Random(31), "llama", n=9)  # (prompts of 1-20 or 49-90 tokens, a budget of 48)
    for i, k in zip((0, 2, 4, 5), (3, 5, 0, 20)):  # (greedy and sampled, beside requests that ask none)
        requests[i][1]["logprobs"] = k
    one, talk = serve_and_talk(build_model("llama", checkpoint=path, max_tokens=48), requests)
    four, four_talk = serve_and_talk(build_model("llama", checkpoint=path, max_tokens=48, **GRID), requests)
    assert not multiprocessing.active_children()
    assert four_talk == talk  # (the conversation, the request beside the cancelled one)
    for a, b in zip(one, four):  # (greedy and seeded sampling)
        assert_same_logprobs(a, b)
    assert sum("logprobs" in b for b in four) == 4
    greedy = [(b["tokens"], inputs) for b, (_, inputs) in zip(four, requests) if "temperature" not in inputs]
    assert len(greedy) == 6
    for tokens, inputs in greedy:
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])


def test_a_rank_of_the_last_stage_that_dies_fails_the_requests_and_nothing_is_left_behind():
    engine = Engine([build_model("llama", seed=1, max_tokens=48, **GRID)]).start()
    try:
        kill_a_rank(engine, warm_timeout=60, rank=3)  # (stage 1's shard 1: rank 0 hears of it through rank 2)
    finally:
        engine.stop()
    assert not multiprocessing.active_children()


def test_what_the_ranks_cannot_split_is_refused_when_built(tmp_path):
    with pytest.raises(ValueError, match="pipeline_parallel=3: more stages than the model's 2 layers"):
        build_model("llama", tensor_parallel=2, pipeline_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel=3: num_heads"):
        build_model("llama", tensor_parallel=3, pipeline_parallel=2)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 x pipeline_parallel=2 \(4 ranks\).*CUDA devices"):
        build_model("llama", device="cuda:0", **GRID)
    (tmp_path / "config.json").write_text(json.dumps(dict(to_hf(PRESETS["tiny-llama"]), num_key_value_heads=3,
                                                          num_attention_heads=6, head_dim=16)))
    with pytest.raises(ValueError, match=r"tensor_parallel=2: num_kv_heads \(3\)"):
        build_model("llama", checkpoint=str(tmp_path), **GRID)  # (refused before any weight is read)


@pytest.mark.parametrize("stage, shard", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_stage_0s_shard_0_alone_gets_the_tokens_back_and_the_last_stages_shard_0_alone_sends_them(stage, shard):
    from batchmaker.exec.stage_exchange import StageExchange
    fake = FakeStage(stage, 2, shard)
    exchange = StageExchange(fake, 8, torch.float32, torch.device("cpu"))
    out = exchange.around(lambda inbox: torch.ones(2, 5, 8) if stage == 0 else torch.tensor([7, 7]), 5, 2)
    expected = {(0, 0): ["send", "receive_tokens"], (0, 1): ["send"], (1, 0): ["receive", "send_tokens"],
                (1, 1): ["receive"]}[stage, shard]
    assert [kind for kind, _ in fake.calls] == expected
    assert (out is None) == ((stage, shard) == (0, 1))  # (the last stage's shards return what they sampled)
