"""HF Accelerate's `device_map` offload of a model larger than the host (issue 34's 70B anchor),
what ../shared/probes/offload_probe.py measures for 13B, written for a model that the probe cannot
build: the probe materializes the whole model on the host first (`to_empty(device="cpu")`), 138 GB
for a Llama-2-70B beside 128 GiB. Here the model is laid out on the meta device, `device_map` is
inferred under the weight budget, and each parameter is made where the map puts it: on the GPU for
the layers Accelerate keeps there, in host memory for those it offloads (pageable, as Accelerate
holds them). Then `dispatch_model` and `generate`, timed as the probe times it, and the probe's
output lines (bench/offload_anchor.py parses them), so `--anchor bench/accelerate_offload.py
--probe-preset llama-2-70b` runs it in place of the probe, under the same cap (bench/capped_probe.py).

Weights are a constant (the probe's 0.001: values do not change the speed); the config is this
project's preset (batchmaker/cells/decoder_config.PRESETS) as a transformers LlamaConfig.

    python bench/accelerate_offload.py --preset llama-2-70b --gpu-gib 52 --batches 64 --prompt 512 --new 32
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from batchmaker.cells.decoder_config import PRESETS, to_hf  # noqa: E402

FILL = 0.001


def hf_config(name: str):
    """The preset as transformers' LlamaConfig (decoder_config.to_hf: what save_pretrained writes)."""
    from transformers import LlamaConfig
    return LlamaConfig(**to_hf(PRESETS[name]))


def placed_model(name: str, gpu_gib: int, device: str):
    """The model with each parameter made on its `device_map` place; (model, map, GPU entries)."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import LlamaForCausalLM
    cfg = hf_config(name)
    with init_empty_weights():
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    on_cuda = torch.device(device).type == "cuda"  # (a CPU: every module in host memory, a smoke test)
    budget = {torch.device(device).index or 0: f"{gpu_gib}GiB"} if on_cuda else {}
    dmap = infer_auto_device_map(model, max_memory={**budget, "cpu": "1000GiB"},
                                 no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.bfloat16)
    if "disk" in dmap.values():
        raise SystemExit("device_map put modules on disk: not measured")
    for param_name, p in list(model.named_parameters()):
        place = _place(dmap, param_name)
        target = device if place != "cpu" else "cpu"
        set_module_tensor_to_device(model, param_name, target,
                                    value=torch.full(p.shape, FILL, dtype=torch.bfloat16, device=target))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # (its buffer made off the meta device)
    model.eval()
    on_gpu = sum(1 for v in dmap.values() if v != "cpu")
    return dispatch_model(model, device_map=dmap), dmap, on_gpu


def _place(dmap: dict, param_name: str):
    """The device_map entry of the longest module prefix of `param_name` ("" maps the whole model)."""
    module = param_name
    while module not in dmap:
        if not module:
            raise KeyError(f"{param_name}: no device_map entry")
        module = module.rpartition(".")[0]
    return dmap[module]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-2-70b")
    ap.add_argument("--gpu-gib", type=int, default=52, help="device_map's weight budget on the GPU")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda":
        torch.cuda.set_device(args.device)
    start = time.perf_counter()
    model, dmap, on_gpu = placed_model(args.preset, args.gpu_gib, args.device)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"built {args.preset} ({total / 1e9:.1f} GB) where device_map puts it in {time.perf_counter() - start:.0f} s",
          flush=True)
    print(f"device map: {on_gpu} of {len(dmap)} entries on the GPU (budget {args.gpu_gib} GiB)", flush=True)
    vocab = model.config.vocab_size
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.randint(3, vocab, (batch, args.prompt), device=args.device)
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
            _sync(args.device)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            _sync(args.device)
        seconds = time.perf_counter() - start
        print(f"accelerate offload {args.preset} gpu {args.gpu_gib} GiB B={batch} prompt {args.prompt} new {args.new}: "
              f"{seconds:.1f} s, {batch * args.new / seconds:.2f} generated tok/s", flush=True)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
