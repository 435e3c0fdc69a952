"""Tensor-parallel decoders through the engine (exec/tensor_group.py): rank 0 plans, the other ranks
are processes the engine starts (gloo on the CPU), and every rank runs the same plans. Tokens must
be those of one rank and of HF transformers (Llama with as many kv heads as heads or fewer than the
ranks, OPT), under continuous batching, for conversations, with cancels; an LSTM and a TreeLSTM
served beside keep their outputs; a rank that dies fails the requests instead of hanging; stopping
leaves no process."""
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch

from batchmaker import Engine, EngineConfig
from batchmaker.errors import BatchMakerError, CancelledError
from batchmaker.registry import build_model
from helpers import save_perturbed, wait_idle
from test_generation import HF, assert_sent_at_once_equal_hf, drive, hf_greedy, step
from test_models import assert_same, lstm_case, treelstm_case

transformers = pytest.importorskip("transformers")

from batchmaker.cells.decoder_config import PRESETS, to_hf  # noqa: E402

TINY_HF = {"llama-mha": ("llama", {"num_key_value_heads": 4}),  # (as many kv heads as heads)
           "llama-one-kv": ("llama", {"num_key_value_heads": 1}),  # (fewer than the ranks: replicated)
           "opt": ("opt", {})}


def workload(rng: random.Random, family: str, n: int = 10) -> list:
    """Greedy and seeded-sampling requests; some prompts longer than the token budget (48)."""
    requests = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(rng.choice([rng.randint(1, 20), rng.randint(49, 90)]))]
        inputs = {"tokens": prompt, "max_new_tokens": rng.randint(1, 12), "ignore_eos": True}
        if i % 3 == 2:
            inputs.update(temperature=0.8, top_k=40, seed=i)
        requests.append((family, inputs))
    return requests


def serve(model, requests: list, seed: int) -> list:
    engine = Engine([model]).start(thread=False)
    try:
        return [f.result(0).outputs["tokens"] for f in drive(engine, requests, random.Random(seed))]
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """A HF Llama with one kv head (fewer than the ranks: replicated), saved as users have it."""
    config = to_hf(PRESETS["tiny-llama"])
    config["num_key_value_heads"] = 1
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    path = tmp_path_factory.mktemp("one-kv")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_two_ranks_give_the_tokens_of_one(family):
    requests = workload(random.Random(1), family)
    one = serve(build_model(family, seed=2, max_tokens=48), requests, seed=4)
    two = serve(build_model(family, seed=2, max_tokens=48, tensor_parallel=2), requests, seed=4)
    assert two == one and len(one) == len(requests)
    assert not multiprocessing.active_children()  # (the rank's process is gone)


def test_replicated_kv_heads_follow_hf(one_kv_head):
    path, hf = one_kv_head
    requests = [r for r in workload(random.Random(2), "llama") if "temperature" not in r[1]]
    two = serve(build_model("llama", checkpoint=path, max_tokens=48, tensor_parallel=2), requests, seed=6)
    for tokens, (_, inputs) in zip(two, requests):
        assert tokens == hf_greedy(hf, inputs["tokens"], inputs["max_new_tokens"])


def save_tiny(name: str, path) -> torch.nn.Module:
    """The tiny preset of TINY_HF[name]'s family as a HF model, every weight perturbed (OPT's biases
    too), saved as users have it."""
    family, change = TINY_HF[name]
    config_class, model_class = (getattr(transformers, n) for n in HF[family])
    return save_perturbed(config_class, model_class, {**to_hf(PRESETS[f"tiny-{family}"]), **change}, path)


@pytest.mark.parametrize("name", list(TINY_HF))
def test_two_ranks_follow_hf_for_requests_sent_at_once(name, tmp_path):
    hf = save_tiny(name, tmp_path)
    assert_sent_at_once_equal_hf(hf, tmp_path, family=TINY_HF[name][0], tensor_parallel=2)
    assert not multiprocessing.active_children()


def converse_and_cancel(engine) -> tuple:
    """Three turns of a conversation, then a long request cancelled mid-stream beside a short one:
    the turns' tokens and the short one's (what every parallel degree must give alike)."""
    replies, cid = [], True
    for turn in range(3):
        f = engine.submit("llama", {"tokens": [7 + turn, 11, 13] * (turn + 1), "max_new_tokens": 6,
                                    "conversation": cid, "ignore_eos": True})
        while not f.done():
            step(engine)
        out = f.result(0).outputs
        replies.append(out["tokens"])
        cid = out["conversation"]
    long = engine.submit("llama", {"tokens": [5] * 30, "max_new_tokens": 40, "ignore_eos": True})
    other = engine.submit("llama", {"tokens": [9] * 10, "max_new_tokens": 5, "ignore_eos": True})
    for _ in range(4):
        step(engine)
    engine.cancel(long.request_id)
    while not (long.done() and other.done()):
        step(engine)
    with pytest.raises(CancelledError):
        long.result(0)
    return replies, other.result(0).outputs["tokens"]


def test_a_conversation_and_a_cancel_on_two_ranks():
    def run(tp: int) -> tuple:
        engine = Engine([build_model("llama", seed=3, max_tokens=48, tensor_parallel=tp)]).start(thread=False)
        try:
            got = converse_and_cancel(engine)
            queue = engine.structured["llama"].queue
            assert all(q.num_active == 0 for q in queue.sequences.values())
            return got
        finally:
            engine.stop()
    assert run(2) == run(1)


def kill_a_rank(engine, warm_timeout: float = 30.0, settle: float = 0.0, rank: int = 1, sig=signal.SIGKILL,
                within: float = 10.0) -> list:
    """Rank `rank`'s process sent `sig` (killed; SIGSTOP: hung) while four long requests run: each
    fails within `within` seconds; returns their errors."""
    engine.submit("llama", {"tokens": [3, 4, 5], "max_new_tokens": 2, "ignore_eos": True}).result(warm_timeout)
    futures = [engine.submit("llama", {"tokens": [i + 1] * 8, "max_new_tokens": 200, "ignore_eos": True})
               for i in range(4)]
    time.sleep(settle)
    group = next(iter(engine.workers[0].iterations.values())).ranks
    os.kill(group.processes[rank - 1].pid, sig)
    start = time.monotonic()
    errors = [f.exception(within + 5) for f in futures]
    assert all(isinstance(e, BatchMakerError) for e in errors), errors
    assert time.monotonic() - start < within
    return errors


def test_a_rank_that_dies_fails_the_requests_and_nothing_is_left_behind():
    engine = Engine([build_model("llama", seed=1, max_tokens=48, tensor_parallel=2)]).start()
    try:
        kill_a_rank(engine)
    finally:
        engine.stop()
    assert not multiprocessing.active_children()


def test_configs_and_devices_the_ranks_cannot_take_are_refused_when_built():
    with pytest.raises(ValueError, match="num_heads"):
        build_model("llama", tensor_parallel=3)  # 4 heads
    with pytest.raises(ValueError, match="tensor_parallel"):
        build_model("llama", tensor_parallel=0)
    with pytest.raises(ValueError, match="CUDA devices"):
        build_model("llama", tensor_parallel=torch.cuda.device_count() + 1, device="cuda:0")


def test_two_groups_and_a_second_worker_in_one_engine():
    """Each group is a process group of its own (not torch.distributed's default one); a worker
    that does not serve a tensor-parallel decoder forms nothing for it."""
    models = [build_model("llama", seed=2, max_tokens=48, tensor_parallel=2),
              build_model("opt", seed=2, max_tokens=48, tensor_parallel=2)]
    requests = [r for family in ("llama", "opt") for r in workload(random.Random(3), family, n=4)]
    engine = Engine(models, EngineConfig(devices=("cpu", "cpu"))).start()
    try:
        two = [engine.submit(model, inputs).result(60).outputs["tokens"] for model, inputs in requests]
    finally:
        engine.stop()
    assert not multiprocessing.active_children()
    one = [serve(build_model(model, seed=2, max_tokens=48), [(model, inputs)], seed=0)[0] for model, inputs in requests]
    assert two == one


def test_lstm_and_treelstm_beside_two_ranks_in_one_engine():
    """The RNN and tree models keep a worker on each device beside a tensor-parallel decoder on the
    first: requests to the three interleaved, each RNN output that of the request run alone (batched
    all the same), the decoder's tokens those of one rank."""
    rng = random.Random(8)
    lstm, lstm_inputs, lstm_reference = lstm_case(rng)
    tree, tree_inputs, tree_reference = treelstm_case(rng)
    decoder = workload(random.Random(9), "llama", n=8)
    arrivals = [("lstm", i) for i in lstm_inputs[:40]] + [("treelstm", i) for i in tree_inputs[:20]] + decoder
    rng.shuffle(arrivals)
    models = [lstm, tree, build_model("llama", seed=2, max_tokens=48, tensor_parallel=2)]
    engine = Engine(models, EngineConfig(devices=("cpu", "cpu"))).start()
    try:
        futures = []
        for model, inputs in arrivals:
            futures.append(engine.submit(model, inputs))
            time.sleep(rng.random() * 0.002)  # (requests join running work mid-flight)
        outputs = [f.result(60).outputs for f in futures]
        stats = wait_idle(engine)
    finally:
        engine.stop()
    assert not multiprocessing.active_children()
    references = {"lstm": (lstm, lstm_reference), "treelstm": (tree, tree_reference)}
    for (model, inputs), out in zip(arrivals, outputs):
        if model in references:
            built, reference = references[model]
            assert_same(out, reference(built, inputs))
    served = [(inputs, out["tokens"]) for (model, inputs), out in zip(arrivals, outputs) if model == "llama"]
    one = serve(build_model("llama", seed=2, max_tokens=48), [("llama", inputs) for inputs, _ in served], seed=0)
    assert [tokens for _, tokens in served] == one
    for name in ("lstm/", "treelstm/", "llama/"):  # (keys "model/cell:batch size")
        assert max(int(k.rsplit(":", 1)[1]) for k in stats["batch_sizes"] if k.startswith(name)) > 1, name


def test_an_iteration_that_fails_on_rank_0_breaks_the_group_at_once():
    """The other ranks may be left inside a collective: the group stops its ranks, and every later
    iteration fails at once instead of waiting for a collective's timeout."""
    engine = Engine([build_model("llama", seed=1, max_tokens=48, tensor_parallel=2)]).start()
    try:
        assert engine.submit("llama", {"tokens": [3, 4], "max_new_tokens": 2}).result(30)
        group = next(iter(engine.workers[0].iterations.values())).ranks

        def boom(x):
            raise RuntimeError("injected")
        group.lm.layers[1].mlp.reduce = boom
        start = time.monotonic()
        with pytest.raises(BatchMakerError, match="injected"):
            engine.submit("llama", {"tokens": [5, 6], "max_new_tokens": 2}).result(30)
        assert not multiprocessing.active_children()
        with pytest.raises(BatchMakerError, match="broken"):
            engine.submit("llama", {"tokens": [7], "max_new_tokens": 2}).result(30)
        assert time.monotonic() - start < 5.0
    finally:
        engine.stop()


def test_the_host_tier_is_the_whole_models_over_the_ranks():
    """host_bytes is the whole model's: each rank keeps as many chunks, each of its part of the K/V."""
    facts = []
    for tp in (1, 2):
        engine = Engine([build_model("llama", seed=1, max_tokens=48, tensor_parallel=tp, host_bytes=1 << 20)]).start()
        try:
            facts.append(next(iter(engine.workers[0].decoder_facts.values())))
        finally:
            engine.stop()
    assert facts[0].host_chunks == facts[1].host_chunks > 0 and facts[0].chunk_bytes == facts[1].chunk_bytes
