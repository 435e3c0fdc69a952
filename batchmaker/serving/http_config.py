"""The HTTP front's settings (batchmaker/serving/http.py). Standard library only: the command line
checks `--http` before it builds a model, and without importing aiohttp."""
import importlib.util
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

_ADDRESS = re.compile(r"(?P<host>\[[0-9a-fA-F:.]+\]|[\w.\-]+):(?P<port>\d{1,5})")


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"  # loopback by default, as the ZeroMQ socket
    port: int = 8000  # 0: any free port (HttpFront.port says which)
    api_key: str | None = None  # Bearer token the /v1 routes require; required beyond loopback
    chat_template: str | None = None  # a Jinja file that replaces every model's chat template
    max_body_bytes: int = 16 << 20  # aiohttp's default (1 MiB) is less than a long chat history
    drain_timeout: float = 10.0  # seconds stop() lets running requests finish before cancelling them

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"--http: port {self.port} is not in [0, 65535]")
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"--http {self.host}:{self.port} is reachable from other machines: "
                             "give it --api-key (clients send it as 'Authorization: Bearer KEY')")


def config_from_flags(address: str | None, api_key: str | None, chat_template: Path | None,
                      drain_timeout: float) -> HttpConfig | None:
    """`batchmaker serve --http HOST:PORT [--api-key KEY] [--chat-template FILE]`; None without --http.
    ValueError names the flag at fault."""
    if address is None:
        if api_key is not None or chat_template is not None:
            raise ValueError("--api-key and --chat-template go with --http HOST:PORT")
        return None
    missing = [m for m in ("aiohttp", "jinja2", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--http needs {', '.join(missing)}: pip install 'batchmaker[http]'")
    if chat_template is not None and not Path(chat_template).is_file():
        raise ValueError(f"--chat-template {chat_template}: no such file")
    host, port = parse_http_address(address)
    return HttpConfig(host, port, api_key, None if chat_template is None else str(chat_template),
                      drain_timeout=drain_timeout)


def parse_http_address(text: str) -> tuple[str, int]:
    """'127.0.0.1:8000', '[::1]:8000', 'localhost:8000', '0.0.0.0:8000' -> (host, port)."""
    match = _ADDRESS.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--http {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return match["host"].strip("[]"), int(match["port"])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything
