"""Command line.

    batchmaker demo                         # server + client in one process, Poisson load, a table
    batchmaker serve [--models lstm,seq2seq,treelstm] [--address tcp://127.0.0.1:5555] [--devices cpu]
    batchmaker client infer seq2seq '{"tokens": [5, 17, 42]}' [--stream]
    batchmaker client models | stats | health
    batchmaker keygen NAME                  # NAME.key (secret) and NAME.pub (public), for CurveZMQ
"""
import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

log = logging.getLogger("batchmaker")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(name)s: %(message)s")
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchmaker", description="Cellular batching server (BatchMaker).")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="serve the built-in models in process and drive them with the client")
    demo.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    demo.add_argument("--rate", type=float, default=10.0, help="arrivals per second per model")
    demo.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 if present)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)

    serve = sub.add_parser("serve", help="serve models over ZeroMQ until SIGTERM/SIGINT")
    serve.add_argument("--models", default="lstm,seq2seq,treelstm",
                       help="comma-separated registered names or module:attribute (a Model or a factory)")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="size of the built-in models, e.g. --set hidden=1024 --set dtype=float16")
    serve.add_argument("--address", default=DEFAULT_ADDRESS, help="tcp://host:port or ipc:///path")
    serve.add_argument("--devices", default="cpu", help="comma-separated: cpu, cuda:0, cuda:1, ...")
    serve.add_argument("--max-requests", type=int, default=4096, help="queued+running bound; beyond: overloaded")
    serve.add_argument("--max-message-bytes", type=int, default=16 << 20)
    serve.add_argument("--drain-timeout", type=float, default=10.0, help="seconds to finish in-flight work on stop")
    serve.add_argument("--curve-secret-key", type=Path, help="file with the server's z85 secret key")
    serve.add_argument("--curve-clients", type=Path, nargs="+", default=[],
                       help="files with the z85 public keys of the clients allowed in")
    serve.set_defaults(run=_serve)

    client = sub.add_parser("client", help="send one request to a server and print the JSON reply")
    client.add_argument("op", choices=["infer", "models", "stats", "health"])
    client.add_argument("model", nargs="?", help="infer: the model name")
    client.add_argument("inputs", nargs="?", help="infer: the inputs as JSON")
    client.add_argument("--address", default=DEFAULT_ADDRESS)
    client.add_argument("--stream", action="store_true", help="infer: print streamed outputs as they come")
    client.add_argument("--priority", type=int, default=0)
    client.add_argument("--deadline-ms", type=float, default=None)
    client.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the reply")
    client.add_argument("--curve-server-key", type=Path, help="file with the server's z85 public key")
    client.add_argument("--curve-secret-key", type=Path, help="file with this client's z85 secret key")
    client.set_defaults(run=_client)

    keygen = sub.add_parser("keygen", help="write a CurveZMQ key pair: NAME.key (secret), NAME.pub (public)")
    keygen.add_argument("name", type=Path)
    keygen.set_defaults(run=_keygen)
    return parser


def _demo(args) -> int:
    from batchmaker.serving.demo import run_demo
    return run_demo(args.duration, args.rate, args.device, args.seed)


def _serve(args) -> int:
    from batchmaker.engine import Engine, EngineConfig
    from batchmaker.registry import load_model
    from batchmaker.serving.server import Server, ServerConfig

    sizes = dict(_key_value(item) for item in args.set)
    models = [load_model(spec.strip(), **sizes) for spec in args.models.split(",") if spec.strip()]
    devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
    config = ServerConfig(args.address, max_message_bytes=args.max_message_bytes, drain_timeout=args.drain_timeout,
                          curve_secret_key=_read_key(args.curve_secret_key),
                          curve_client_keys=tuple(_read_key(p) for p in args.curve_clients))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Engine(models, EngineConfig(devices=devices, max_requests=args.max_requests)) as engine:
        server = Server(engine, config).start()
        for m in models:
            log.info("model %s: cells %s, inputs %s", m.name, sorted(m.cells), sorted(m.input_schema))
        log.info("serving %s on %s (devices %s%s)", ", ".join(m.name for m in models), server.address,
                 ",".join(devices), ", CurveZMQ" if config.curve_secret_key else "")
        stop.wait()
        log.info("stopping: draining in-flight requests for up to %g s", config.drain_timeout)
        server.stop()
    log.info("stopped")
    return 0


def _client(args) -> int:
    from batchmaker.serving.client import Client
    from batchmaker.errors import BatchMakerError

    keys = {}
    if args.curve_server_key:
        keys = dict(curve_server_key=_read_key(args.curve_server_key), curve_secret_key=_read_key(args.curve_secret_key))
    with Client(args.address, timeout=args.timeout, **keys) as client:
        try:
            if args.op != "infer":
                print(json.dumps(getattr(client, args.op)(), indent=2, default=_jsonable))
                return 0
            if args.model is None or args.inputs is None:
                print("infer needs MODEL and INPUTS (JSON)", file=sys.stderr)
                return 2
            options = dict(priority=args.priority, deadline=None if args.deadline_ms is None else args.deadline_ms / 1e3)
            inputs = json.loads(args.inputs)
            if args.stream:
                stream = client.stream(args.model, inputs, **options)
                for partial in stream:
                    print(json.dumps({"partial": partial}, default=_jsonable), flush=True)
                result = stream.result()
            else:
                result = client.submit(args.model, inputs, **options).result()
            print(json.dumps({"outputs": result.outputs, "latency_ms": round(result.timing.latency * 1e3, 3)},
                             default=_jsonable))
            return 0
        except (BatchMakerError, json.JSONDecodeError) as e:
            print(json.dumps({"error": getattr(e, "code", "bad_request"), "message": str(e)}), file=sys.stderr)
            return 1


def _keygen(args) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    secret_path, public_path = args.name.with_suffix(".key"), args.name.with_suffix(".pub")
    secret_path.write_bytes(secret + b"\n")
    secret_path.chmod(0o600)
    public_path.write_bytes(public + b"\n")
    print(f"wrote {secret_path} (secret: keep it) and {public_path} (public: give it out)")
    return 0


def _read_key(path: Path | None) -> bytes | None:
    if path is None:
        return None
    key = path.read_bytes().strip()
    if len(key) != 40:
        raise SystemExit(f"{path}: expected a 40-character z85 key (see `batchmaker keygen`)")
    return key


def _key_value(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)  # numbers, booleans
    except json.JSONDecodeError:
        return key, value  # strings such as float16


def _jsonable(value):
    if hasattr(value, "tolist"):  # tensors and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


if __name__ == "__main__":
    sys.exit(main())
