"""Command line: `batchmaker demo | serve | generate | client | keygen` (EXAMPLES below).

Mistakes (a port in use, an unknown model, a bad --set, a missing key file) print one line and
exit non-zero; --debug (or --log-level debug) shows the traceback instead.

Only the standard library is imported here: each subcommand imports what it needs, so `--help`
and `client` start without torch (bench/cli_startup.py measures it).
"""
import argparse
import json
import logging
import re
import signal
import sys
import threading
from pathlib import Path

from batchmaker.serving.cli_models import UsageError, check_devices, load_models, replicas_of

log = logging.getLogger("batchmaker")

EXAMPLES = """examples:
  batchmaker demo                         # server + client in one process, Poisson load, a table
  batchmaker serve [--models lstm,seq2seq,treelstm] [--address tcp://127.0.0.1:5555] [--devices cpu]
  batchmaker serve --models llama --set checkpoint=/models/Llama-2-7b-hf --set dtype=bfloat16 --devices cuda:0
  batchmaker serve --models lstm,treelstm --devices cuda:0,cuda:1 --replicas   # a process per device
  batchmaker serve --models llama --set checkpoint=DIR --http 127.0.0.1:8000   # + the OpenAI HTTP API
  batchmaker generate --models llama --set llama.checkpoint=DIR --input prompts.jsonl --output out.jsonl
  batchmaker generate --models llama --set checkpoint=DIR --set offload=auto --devices cuda:0 \
      --input prompts.jsonl --output out.jsonl    # FlexGen's offloading: a model larger than the GPU
  batchmaker client infer seq2seq '{"tokens": [5, 17, 42]}' [--stream]
  batchmaker client infer llama '{"tokens": [1, 450, 73], "max_new_tokens": 16}' --stream
  batchmaker client chat llama '{"max_new_tokens": 16}' < turns.txt   # one turn of token ids a line
  batchmaker client models | stats | health
  batchmaker keygen NAME                  # NAME.key (secret) and NAME.pub (public), for CurveZMQ"""
DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
LOG_LEVELS = ("debug", "info", "warning", "error")
_ADDRESS = re.compile(r"(tcp|ipc|inproc)://.+")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    log_level = getattr(args, "log_level", "info")
    debug = getattr(args, "debug", False) or log_level == "debug"
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C before serve installs its handler (while models build)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"batchmaker {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


def _one_line(error: Exception) -> str:
    """The error's message; for a kind of error users do not cause, its type and where to look."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if text and isinstance(error, (UsageError, OSError, ValueError, LookupError)):  # bind, files, models
        return text
    return f"{type(error).__name__}: {text} (run with --debug for the traceback)"


# parser ---------------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" where a default says something (not None, False or an empty list)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """`epilog_from` builds the epilog when help is shown: listing the model options imports the
    models (torch), which `batchmaker --help` must not pay for."""

    def __init__(self, *args, epilog_from=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.epilog_from = epilog_from

    def format_help(self) -> str:
        if self.epilog_from is not None:
            self.epilog, self.epilog_from = self.epilog_from(), None
        return super().format_help()


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)  # accepted before and after the subcommand
    common.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help="log verbosity (default: info)")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error instead of one line")
    parser = _Parser(prog="batchmaker", description="Cellular batching server (BatchMaker).", parents=[common],
                     epilog=EXAMPLES, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    options = dict(parents=[common], formatter_class=_HelpFormatter)

    demo = sub.add_parser("demo", help="serve the built-in models in process and drive them with the client",
                          description="A server and a client in this process: Poisson load on the built-in\n"
                                      "models (LSTM, Seq2Seq, TreeLSTM at hidden 128; a tiny Llama),\n"
                                      "then a table per model.", **options)
    demo.add_argument("--duration", type=float, default=20.0, metavar="SECONDS", help="seconds of load")
    demo.add_argument("--rate", type=float, default=10.0, metavar="PER_SECOND", help="arrivals per second per model")
    demo.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 when present, else cpu)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the arrivals and of the requests drawn")
    demo.set_defaults(run=_demo)

    serve = sub.add_parser("serve", help="serve models over ZeroMQ until SIGTERM/SIGINT",
                           description="Serve models over ZeroMQ (protocol: docs/protocol.md) until\n"
                                       "SIGTERM/SIGINT, then drain in-flight requests.",
                           epilog_from=_model_options_epilog, **options)
    serve.add_argument("--models", default="lstm,seq2seq,treelstm",
                       help="comma-separated registered names, or module:attribute naming a Model or a function "
                            "that returns one; the current directory is importable, as with `python -m`")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="an option of the registered models served, e.g. --set hidden=1024; MODEL.KEY=VALUE for "
                            "one model only, e.g. --set llama.checkpoint=DIR (repeatable; keys below); generate's offload "
                            "keys (llama.offload=auto ...) serve a decoder offloaded, in blocks, greedy only")
    serve.add_argument("--address", default=DEFAULT_ADDRESS, help="tcp://HOST:PORT or ipc:///PATH to bind")
    serve.add_argument("--devices", default="cpu", help="comma-separated: cpu, cuda:0, cuda:1, ... (one worker each)")
    serve.add_argument("--replicas", action="store_true",
                       help="one replica process per device, each an engine of its own, behind a front that "
                            "routes to the least loaded (the RNN and tree models; not decoders)")
    serve.add_argument("--max-requests", type=int, default=4096, metavar="N",
                       help="infer requests queued or running at once; beyond it new ones are answered overloaded")
    serve.add_argument("--max-message-bytes", type=int, default=16 << 20, metavar="BYTES",
                       help="largest request frame; ZeroMQ drops the connection of a client that sends a larger one")
    serve.add_argument("--drain-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="seconds in-flight requests may finish on SIGTERM/SIGINT before they are cancelled")
    serve.add_argument("--curve-secret-key", type=Path, metavar="FILE", help="file with the server's z85 secret key: turns CurveZMQ on")
    serve.add_argument("--curve-clients", type=Path, nargs="+", default=[], metavar="FILE",
                       help="files with the z85 public keys of the clients allowed in (with --curve-secret-key)")
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API here, e.g. 127.0.0.1:8000 (decoders with a "
                            "tokenizer.json, with prefix caching unless --set prefix_caching=false; needs pip "
                            "install 'batchmaker[http]')")
    serve.add_argument("--api-key", metavar="KEY", help="--http: the Bearer key clients must send to /v1 routes "
                                                        "(required where HOST is not loopback)")
    serve.add_argument("--chat-template", type=Path, metavar="FILE",
                       help="--http: a Jinja chat template used instead of the checkpoints' own")
    serve.set_defaults(run=_serve)

    generate = sub.add_parser("generate", help="generate for a file of prompts, offline (resumable)",
                              description="Greedy generation for a JSON-lines file of prompts (id, tokens or prompt,\n"
                                          "max_new_tokens), a line per finished prompt appended to --output; a re-run\n"
                                          "skips the ids already there. --set offload=auto: FlexGen's offloading.",
                              epilog_from=_model_options_epilog, **options)
    generate.add_argument("--models", default="llama", help="the registered decoder to run: llama or opt")
    generate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="a model option (as for serve), or offload=auto|none|weights+cache+hidden, "
                               "gpu_memory=SIZE, gpu_batch=N, num_batches=N (repeatable)")
    generate.add_argument("--input", type=Path, required=True, help="JSON-lines file of prompts")
    generate.add_argument("--output", type=Path, required=True, help="JSON-lines file the results are appended to")
    generate.add_argument("--devices", default="cpu", help="the device: cpu or cuda:N")
    generate.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                          help="tokens to generate for a prompt that does not say")
    generate.add_argument("--max-prompts", type=int, default=None, metavar="N",
                          help="stop after this many prompts (the rest on a later run)")
    generate.set_defaults(run=_generate)

    client = sub.add_parser("client", help="send one request to a server and print the JSON reply",
                            description="Send one request and print the reply as JSON (a failed request:\n"
                                        "JSON on stderr, exit status 1). `chat` holds a conversation with a\n"
                                        "decoder: one turn per line of stdin, one reply per turn, ended at EOF.",
                            **options)
    client.add_argument("op", choices=["infer", "chat", "models", "stats", "health"], help="the request to send")
    client.add_argument("model", nargs="?", help="infer, chat: the model name")
    client.add_argument("inputs", nargs="?", help="infer: the inputs as JSON, e.g. '{\"tokens\": [5, 6]}'; "
                                                  "chat: settings sent with every turn, e.g. '{\"max_new_tokens\": 16}'")
    client.add_argument("--address", default=DEFAULT_ADDRESS, help="the server's tcp://HOST:PORT or ipc:///PATH")
    client.add_argument("--stream", action="store_true", help="infer, chat: print streamed outputs as they come")
    client.add_argument("--text", action="store_true",
                        help="chat: send each line as a text prompt (a model with a tokenizer), not as token ids")
    client.add_argument("--priority", type=int, default=0, metavar="N",
                        help="infer: higher runs first among requests of the same model (32-bit integer)")
    client.add_argument("--deadline-ms", type=float, default=None, metavar="MS",
                        help="infer: the server fails the request with deadline_exceeded after this many ms")
    client.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="seconds to wait for the reply")
    client.add_argument("--curve-server-key", type=Path, metavar="FILE", help="file with the server's z85 public key")
    client.add_argument("--curve-secret-key", type=Path, metavar="FILE", help="file with this client's z85 secret key")
    client.set_defaults(run=_client)

    keygen = sub.add_parser("keygen", help="write a CurveZMQ key pair: NAME.key (secret), NAME.pub (public)",
                            **options)
    keygen.add_argument("name", type=Path, help="path of the pair without suffix, e.g. keys/server")
    keygen.set_defaults(run=_keygen)
    return parser


def _model_options_epilog() -> str:
    from batchmaker.registry import registered_models
    from batchmaker.serving.model_options import describe

    return "options of the registered models (--set KEY=VALUE applies to each served model that takes KEY,\n" \
           "--set MODEL.KEY=VALUE to MODEL only; a decoder's device defaults to the first of --devices):\n" \
           + describe(registered_models())


# subcommands ----------------------------------------------------------------------------------
def _demo(args) -> int:
    device = check_devices(args.device, "--device")[0] if args.device else None
    from batchmaker.serving.demo import run_demo

    return run_demo(args.duration, args.rate, device, args.seed)


def _serve(args) -> int:
    from batchmaker.launch import launched
    launch = launched()
    if launch is not None and launch.rank > 0:  # (torchrun: rank 0 serves, the others run its plans)
        from batchmaker.exec.tensor_launch import follow
        log.info("rank %d of %d: following rank 0 at %s", launch.rank, launch.size, launch.master_addr)
        return follow(launch)
    config, http = _serving_configs(args)
    devices = check_devices(args.devices, "--devices")
    from batchmaker.engine_config import EngineConfig
    from batchmaker.serving.server import Server

    specs = [s.strip() for s in args.models.split(",") if s.strip()]
    engine_config = EngineConfig(devices=devices, max_requests=args.max_requests)
    if args.replicas:
        engine = replicas_of(specs, args.set, engine_config)
    else:
        from batchmaker.engine import Engine
        engine = Engine(load_models(specs, args.set, devices, http=http is not None), engine_config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with engine:
        server = Server(engine, config).start()
        front = None
        if http is not None:  # (aiohttp is imported only here)
            from batchmaker.serving.http import HttpFront
            front = HttpFront(engine, http).start()
        for m in engine.models.values():
            log.info("model %s: cells %s, inputs %s", m.name, sorted(m.cells), sorted(m.input_schema))
        log.info("serving %s on %s (devices %s%s%s)", ", ".join(engine.models), server.address, ",".join(devices),
                 ", a replica each" if args.replicas else "", ", CurveZMQ" if config.curve_secret_key else "")
        while not stop.wait(0.5):
            if broken := engine.broken():  # (its requests fail at once: better no server than a broken one)
                log.error("stopping: %s", "; ".join(f"model {m} cannot serve: {why}" for m, why in broken.items()))
                break
        log.info("stopping: draining in-flight requests for up to %g s", config.drain_timeout)
        if front is not None:
            front.stop()
        server.stop()
    log.info("stopped")
    return 0 if stop.is_set() else 1


def _serving_configs(args):
    """The ZeroMQ server's config and the HTTP front's (None without --http), checked before any
    model loads."""
    from batchmaker.serving.http_config import config_from_flags
    from batchmaker.serving.server import ServerConfig
    _check_address(args.address)
    if bool(args.curve_secret_key) != bool(args.curve_clients):
        raise UsageError("CurveZMQ needs both --curve-secret-key and --curve-clients")
    keys = dict(curve_secret_key=_read_key(args.curve_secret_key, "--curve-secret-key"),
                curve_client_keys=tuple(_read_key(p, "--curve-clients") for p in args.curve_clients))
    try:
        http = config_from_flags(args.http, args.api_key, args.chat_template, args.drain_timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if http is not None and args.replicas:
        raise UsageError("--http serves decoders, --replicas the RNN and tree models: not both in one server yet")
    return ServerConfig(args.address, max_message_bytes=args.max_message_bytes, drain_timeout=args.drain_timeout,
                        **keys), http


def _generate(args) -> int:
    from batchmaker.serving.generate import run_generate
    from batchmaker.serving.prompt_file import PromptFileError

    try:
        return run_generate(args)
    except PromptFileError as e:
        raise UsageError(str(e)) from None


def _client(args) -> int:
    _check_address(args.address)
    if bool(args.curve_server_key) != bool(args.curve_secret_key):
        raise UsageError("CurveZMQ needs both --curve-server-key and --curve-secret-key")
    keys = {}
    if args.curve_server_key:
        keys = dict(curve_server_key=_read_key(args.curve_server_key, "--curve-server-key"),
                    curve_secret_key=_read_key(args.curve_secret_key, "--curve-secret-key"))
    if args.op == "infer" and (args.model is None or args.inputs is None):
        raise UsageError("infer needs MODEL and INPUTS (JSON), e.g. client infer lstm '{\"tokens\": [5, 6]}'")
    if args.op == "chat" and args.model is None:
        raise UsageError("chat needs MODEL, e.g. client chat llama '{\"max_new_tokens\": 16}' < turns.txt")

    from batchmaker.errors import BatchMakerError
    from batchmaker.serving.client import Client

    with Client(args.address, timeout=args.timeout, **keys) as client:
        try:
            if args.op not in ("infer", "chat"):
                print(json.dumps(getattr(client, args.op)(timeout=args.timeout), indent=2, default=_jsonable))
                return 0
            options = dict(priority=args.priority, deadline=None if args.deadline_ms is None else args.deadline_ms / 1e3)
            inputs = json.loads(args.inputs or "{}")
            if args.op == "chat":
                return _chat(client, args, inputs, options)
            _print_reply(client.stream(args.model, inputs, **options) if args.stream else
                         client.submit(args.model, inputs, **options))
            return 0
        except (BatchMakerError, json.JSONDecodeError) as e:
            _print_error(e)
            return 1


def _chat(client, args, settings: dict, options: dict) -> int:
    """One turn per line of stdin (token ids, or text with --text). A bad_request turn is reported
    and skipped; any other failure (an unknown or expired conversation too) ends the chat. The
    conversation is ended at EOF, and the end's reply printed."""
    from batchmaker.errors import BadRequestError, UnknownConversationError

    if not isinstance(settings, dict):
        raise UsageError(f"chat: the settings must be a JSON object, got {args.inputs}")
    status = 0
    with client.conversation(args.model, **options, **settings) as chat:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                turn = dict(prompt=line.rstrip("\n")) if args.text else dict(tokens=_token_ids(line))
                _print_reply(chat.stream(**turn) if args.stream else chat.submit(**turn))
            except BadRequestError as e:
                _print_error(e)
                status = 1
                if isinstance(e, UnknownConversationError):
                    return 1
        if (ended := chat.end()) is not None:
            print(json.dumps(ended), flush=True)
    return status


def _token_ids(line: str) -> list[int]:
    from batchmaker.errors import BadRequestError

    try:
        return [int(t) for t in re.split(r"[\s,\[\]]+", line) if t]
    except ValueError:
        raise BadRequestError(f"expected token ids separated by spaces or commas, got {line.strip()!r} "
                              "(--text sends text)") from None


def _print_reply(reply) -> None:
    """reply: a Future, or a Stream whose partials are printed as they come; then its outputs."""
    if hasattr(reply, "future"):  # a Stream
        for partial in reply:
            print(json.dumps({"partial": partial}, default=_jsonable), flush=True)
        reply = reply.future
    result = reply.result()
    print(json.dumps({"outputs": result.outputs, "latency_ms": round(result.timing.latency * 1e3, 3)},
                     default=_jsonable), flush=True)


def _print_error(error: Exception) -> None:
    print(json.dumps({"error": getattr(error, "code", "bad_request"), "message": str(error)}), file=sys.stderr)


def _keygen(args) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    secret_path, public_path = args.name.with_suffix(".key"), args.name.with_suffix(".pub")
    secret_path.write_bytes(secret + b"\n")
    secret_path.chmod(0o600)
    public_path.write_bytes(public + b"\n")
    print(f"wrote {secret_path} (secret: keep it) and {public_path} (public: give it out)")
    return 0


# checks -------------------------------------------------------------------------------------
def _check_address(address: str) -> None:
    if not _ADDRESS.fullmatch(address):
        hint = f" (did you mean tcp://{address}?)" if re.fullmatch(r"[\w.\-]+:\d+|\*:\d+", address) else ""
        raise UsageError(f"--address {address!r}: expected tcp://HOST:PORT or ipc:///PATH{hint}")


def _read_key(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise UsageError(f"{flag} {path}: {e.strerror}") from None
    if len(key) != 40:
        raise UsageError(f"{flag} {path}: expected a 40-character z85 key (see `batchmaker keygen`)")
    return key


def _jsonable(value):
    if hasattr(value, "tolist"):  # tensors and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


if __name__ == "__main__":
    sys.exit(main())
